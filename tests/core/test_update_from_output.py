"""`Scheduler.update_from_output`: the scheduler owns request state and applies each sampled
token, its token-level stops and lengths; checked against a brute-force rule, with fan-out
forks, tokens of finished or departed requests dropped, and pending (async) tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import (
    BlockManager,
    SampledToken,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    TokenStops,
)
from pagedjax.core.steady_decode import DecodeCohort, SteadyRun


def _queued(prompt_len: int, max_tokens: int, stops: TokenStops, max_len: int, n: int = 1):
    sched = Scheduler(SchedulerConfig(max_model_len=max_len, max_num_seqs=8),
                      BlockManager(64, 0, 4))
    seq = Sequence(0, list(range(3, 3 + prompt_len)))
    g = SequenceGroup("r", [seq], 0.0, max_tokens=max_tokens, n=n, stops=stops)
    sched.add_seq_group(g)
    return sched, g, seq


def _brute_force(tokens, prompt_len, max_tokens, eos, stop, min_tokens, max_len):
    """(tokens kept, status, reason): the first token that ends the sequence, vLLM's order."""
    for k, tok in enumerate(tokens, 1):
        if k > min_tokens and tok in eos:
            return tokens[:k], SequenceStatus.FINISHED_STOPPED, None
        if k > min_tokens and tok in stop:
            return tokens[:k], SequenceStatus.FINISHED_STOPPED, tok
        if k >= max_tokens or prompt_len + k >= max_len:
            return tokens[:k], SequenceStatus.FINISHED_LENGTH, None
    return tokens, None, None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=30),
       eos=st.frozensets(st.integers(0, 9), max_size=2),
       stop=st.frozensets(st.integers(0, 9), max_size=3),
       min_tokens=st.integers(0, 6), max_tokens=st.integers(1, 40),
       prompt_len=st.integers(1, 10), max_len=st.integers(12, 40))
def test_token_stops_equal_brute_force(tokens, eos, stop, min_tokens, max_tokens, prompt_len,
                                       max_len):
    stops = TokenStops(eos, stop, min_tokens)
    sched, _g, seq = _queued(prompt_len, max_tokens, stops, max_len)
    reasons = []
    for tok in tokens:  # one step per token; tokens after the stop are dropped
        for a in sched.update_from_output([SampledToken("r", seq, tok, -1.0)], lambda: 99):
            reasons.append(a.stop_reason)
    want, status, reason = _brute_force(tokens, prompt_len, max_tokens, eos, stop, min_tokens,
                                        max_len)
    assert seq.output_token_ids == want
    assert seq.cumulative_logprob == -len(want)
    if status is None:
        assert not seq.status.is_finished
    else:
        assert seq.status is status and reasons[-1] == reason
        assert sched.free_finished_seq_groups() == [_g]  # freed and forgotten where it waited
        assert not sched.has_unfinished_seqs()
        assert sched.bm.get_num_free_gpu_blocks() == 64


def test_fan_out_forks_before_appending_and_departed_requests_are_dropped():
    sched, g, seq = _queued(4, 1, TokenStops(), 64, n=3)
    sched.update_after_step(sched.schedule())  # the prompt's blocks, which children share
    ids = iter(range(10, 20))
    applied = sched.update_from_output(
        [SampledToken("r", seq, 7, -0.1), SampledToken("r", seq, 8, -0.2, fork_index=1),
         SampledToken("r", seq, 9, -0.3, fork_index=2)], lambda: next(ids))
    assert [(a.seq.seq_id, a.forked) for a in applied] == [(0, False), (10, True), (11, True)]
    # max_tokens=1 finished the parent first; the children still got their own token.
    assert [s.output_token_ids for s in g.seqs] == [[7], [8], [9]]
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in g.seqs)
    assert sched.free_finished_seq_groups() == [g]
    assert sched.bm.get_num_free_gpu_blocks() == 64
    assert sched.update_from_output([SampledToken("r", seq, 1, 0.0)], lambda: 0) == []


def test_pending_tokens_are_counted_down_and_dropped_after_a_stop():
    sched, g, seq = _queued(4, 10, TokenStops(frozenset({5})), 64)
    seq.num_pending = 2  # two launched steps sample for it (async scheduling)
    assert seq.num_uncomputed_tokens == 6
    sched.update_from_output([SampledToken("r", seq, 5, 0.0, pending=True)], lambda: 0)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.num_pending == 0
    assert sched.update_from_output([SampledToken("r", seq, 6, 0.0, pending=True)],
                                    lambda: 0) == []
    assert seq.output_token_ids == [5]


def test_stop_seq_finishes_for_the_output_processor():
    sched, g, seq = _queued(4, 10, TokenStops(), 64)
    sched.update_from_output([SampledToken("r", seq, 5, 0.0)], lambda: 0)
    sched.stop_seq(seq, SequenceStatus.FINISHED_STOPPED, "r")
    assert sched.free_finished_seq_groups() == [g] and not sched.has_unfinished_seqs()


def test_a_sequence_that_finishes_while_preempted_is_freed_where_it_waits():
    """Async scheduling: a sequence preempted (recompute or swap) while its last token was on
    the device finishes when that token arrives; its group leaves the queue it waits in."""
    from pagedjax.core.scheduler import _Step

    for mode in ("recompute", "swap"):
        sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=8,
                                          preemption_mode=mode), BlockManager(16, 16, 4))
        seq = Sequence(0, list(range(3, 12)))
        g = SequenceGroup("r", [seq], 0.0, max_tokens=10, stops=TokenStops(frozenset({5})))
        sched.add_seq_group(g)
        sched.update_after_step(sched.schedule())
        seq.num_pending = 1  # its first token is being sampled on the device
        st = _Step(64)
        sched.running.remove(g)
        sched._preempt(st, g)
        assert (g in sched.waiting) if mode == "recompute" else (g in sched.swapped)
        sched.update_from_output([SampledToken("r", seq, 5, 0.0, pending=True)], lambda: 0)
        assert seq.status is SequenceStatus.FINISHED_STOPPED
        assert sched.free_finished_seq_groups() == [g], mode
        assert not sched.has_unfinished_seqs()
        assert sched.bm.get_num_free_gpu_blocks() == 16
        assert sched.bm.get_num_free_cpu_blocks() == 16
        sched.bm.check_invariants()


def test_an_aborted_group_finished_elsewhere_leaves_a_new_request_of_its_id_alone():
    """A group that finished while preempted and was then aborted, its id taken at once by a
    new request (a client retrying), is forgotten without touching the new one."""
    from pagedjax.core.scheduler import _Step

    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=8,
                                      preemption_mode="swap"), BlockManager(16, 16, 4))
    seq = Sequence(0, list(range(3, 12)))
    g = SequenceGroup("r", [seq], 0.0, max_tokens=10, stops=TokenStops(frozenset({5})))
    sched.add_seq_group(g)
    sched.update_after_step(sched.schedule())
    seq.num_pending = 1
    sched.running.remove(g)
    sched._preempt(_Step(64), g)
    sched.update_from_output([SampledToken("r", seq, 5, 0.0, pending=True)], lambda: 0)
    assert sched.abort_seq_group("r")
    again = SequenceGroup("r", [Sequence(1, list(range(3, 9)))], 0.0, max_tokens=4)
    sched.add_seq_group(again)
    assert sched.free_finished_seq_groups() == []
    assert sched.has_unfinished_seqs() and sched.abort_seq_group("r")  # still known
    assert sched.bm.get_num_free_gpu_blocks() == 16 and sched.bm.get_num_free_cpu_blocks() == 16
    sched.bm.check_invariants()


class _Owner:
    """The engine's row owner as `update_from_rows` reads it: only its group."""

    def __init__(self, group: SequenceGroup) -> None:
        self.group = group


def _twins(specs, max_len):
    """Two schedulers holding the same lone-sequence groups, one per spec."""
    out = []
    for _ in range(2):
        sched = Scheduler(SchedulerConfig(max_model_len=max_len, max_num_seqs=16),
                          BlockManager(64, 0, 4))
        groups = []
        for i, (prompt_len, max_tokens, eos, stop, min_tokens) in enumerate(specs):
            seq = Sequence(i, list(range(3, 3 + prompt_len)))
            g = SequenceGroup(f"r{i}", [seq], 0.0, max_tokens=max_tokens,
                              stops=TokenStops(eos, stop, min_tokens))
            sched.add_seq_group(g)
            groups.append(g)
        out.append((sched, groups))
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(specs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 12),
                                st.frozensets(st.integers(0, 9), max_size=2),
                                st.frozensets(st.integers(0, 9), max_size=2),
                                st.integers(0, 4)), min_size=1, max_size=6),
       steps=st.lists(st.lists(st.tuples(st.integers(0, 9), st.booleans()), min_size=6,
                               max_size=6), min_size=1, max_size=14),
       aborts=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 5)), max_size=3),
       max_len=st.integers(12, 30), ended_only=st.booleans())
def test_rows_apply_as_sampled_tokens_do(specs, steps, aborts, max_len, ended_only):
    """`update_from_rows` (the engine's plain decode steps) applies a step's rows exactly as
    `update_from_output` applies them as `SampledToken`s: the same tokens kept, logprobs,
    statuses, stop reasons, pending counts and applied entries (with ``ended_only``, those
    that finished their sequence, and the count of all), with sequences finishing, aborted
    between steps, and tokens pending (async scheduling) or not."""
    (ra, ga), (rb, gb) = _twins(specs, max_len)
    for t, row in enumerate(steps):
        for when, which in aborts:
            if when == t and which < len(specs):
                ra.abort_seq_group(f"r{which}")
                rb.abort_seq_group(f"r{which}")
        # Every group is a row, finished or not: a finished one's token is dropped.
        pend = {}
        for i, (g, (_, pending)) in enumerate(zip(ga, row, strict=False)):
            if pending and not g.seqs[0].status.is_finished:
                pend[g.seqs[0].seq_id] = i
                g.seqs[0].num_pending += 1
                gb[i].seqs[0].num_pending += 1
        toks = [tok for tok, _ in row[: len(specs)]]
        lps = [-0.5 * (k + 1) for k in range(len(toks))]
        got, count = ra.update_from_rows([(_Owner(g), g.seqs[0], 0, False) for g in ga], toks,
                                         lps, pend, ended_only)
        want = rb.update_from_output(
            [SampledToken(g.request_id, g.seqs[0], tok, lp, 0, pend.get(g.seqs[0].seq_id) == i)
             for i, (g, tok, lp) in enumerate(zip(gb, toks, lps, strict=True))], lambda: 99)
        assert count == len(want)
        if ended_only:
            want = [a for a in want if a.seq.status.is_finished]
        assert [(a.index, a.seq.seq_id, a.forked, a.stop_reason) for a in got] == \
            [(a.index, a.seq.seq_id, a.forked, a.stop_reason) for a in want]
        for g, h in zip(ga, gb, strict=True):
            x, y = g.seqs[0], h.seqs[0]
            assert (x.output_token_ids, x.cumulative_logprob, x.status, x.num_pending) == \
                (y.output_token_ids, y.cumulative_logprob, y.status, y.num_pending)
        assert [g.request_id for g in ra.free_finished_seq_groups()] == \
            [g.request_id for g in rb.free_finished_seq_groups()]
    assert ra.has_unfinished_seqs() == rb.has_unfinished_seqs()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(specs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 12),
                                st.frozensets(st.integers(0, 9), max_size=2),
                                st.frozensets(st.integers(0, 9), max_size=2),
                                st.integers(0, 4)), min_size=1, max_size=6),
       steps=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2)),
                                         min_size=7, max_size=7), st.booleans()),
                      min_size=1, max_size=14),
       aborts=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 5)), max_size=3),
       max_len=st.integers(12, 30),
       listed_groups=st.frozensets(st.integers(0, 5), max_size=3))
def test_steady_rows_apply_as_rows_do(specs, steps, aborts, max_len, listed_groups):
    """`update_steady` (a steady step of quiet rows: the cohort's sequences, in order) applies
    a step as `update_from_rows(..., ended_only=True)` does: the same tokens, statuses, stop
    reasons, pending counts, ended entries and count, with sequences finishing or aborted
    between steps, the cohort cut down to its running groups on some steps (its columns cut
    with it), a token past the rows (a padded bucket's) and pending tokens on all rows, on
    none or on some (async scheduling: a sequence's certainly-last token is not pending).
    Listed rows (some requests' rows, `listed`) are entered only when they ended, as the
    others, and their cumulative logprobs advance as without ``ended_only``."""
    (ra, ga), (rb, gb) = _twins(specs, max_len)
    cohort = DecodeCohort(gb, [g.seqs[0] for g in gb], [[] for _ in gb], len(gb), 0)
    for t, (row, cut) in enumerate(steps):
        for when, which in aborts:
            if when == t and which < len(specs):
                ra.abort_seq_group(f"r{which}")
                rb.abort_seq_group(f"r{which}")
        if cut:  # as `DecodeCohort.without_gone`: the groups still running, in order
            kept = [i for i, g in enumerate(cohort.groups) if not g.seqs[0].status.is_finished]
            if not kept:
                break
            cohort = cohort.cut(kept)
        index = {g.request_id: i for i, g in enumerate(ga)}
        rows = [index[g.request_id] for g in cohort.groups]  # cohort row -> group
        how = row[-1][1]  # pending: 0 none, 1 every row, 2 the rows marked in `row`
        pend_a, pend_b = {}, {}
        for r, i in enumerate(rows):
            x, y = ga[i].seqs[0], gb[i].seqs[0]
            if x.status.is_finished or how == 0 or (how == 2 and not row[r][1]):
                continue
            pend_a[x.seq_id] = pend_b[y.seq_id] = r
            x.num_pending += 1
            y.num_pending += 1
        toks = [row[r][0] for r in range(len(rows))]
        lps = [-0.25 * (r + 1) for r in range(len(toks))]
        want, want_count = ra.update_from_rows(
            [(_Owner(ga[i]), ga[i].seqs[0], 0, False) for i in rows], toks, lps, pend_a)
        listed = [r for r, i in enumerate(rows) if i in listed_groups]
        want = [a for a in want if a.seq.status.is_finished]
        run = SteadyRun(cohort, [0] * len(rows), None, [])
        # + a padding row's token and logprob
        got, count = rb.update_steady(run, toks + [row[-1][0]], pend_b, listed, lps + [-9.0])
        assert count == want_count
        assert [(a.index, a.seq.seq_id, a.group.request_id, a.forked, a.stop_reason)
                for a in got] == \
            [(a.index, a.seq.seq_id, a.group.request_id, a.forked, a.stop_reason) for a in want]
        for i, (g, h) in enumerate(zip(ga, gb, strict=True)):
            x, y = g.seqs[0], h.seqs[0]
            assert (x.output_token_ids, x.status, x.num_pending) == \
                (y.output_token_ids, y.status, y.num_pending)
            if i in listed_groups:
                assert x.cumulative_logprob == y.cumulative_logprob
        assert [g.request_id for g in ra.free_finished_seq_groups()] == \
            [g.request_id for g in rb.free_finished_seq_groups()]
    assert ra.has_unfinished_seqs() == rb.has_unfinished_seqs()
