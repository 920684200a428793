import pytest
from core_sim import FakeEngine, reference_output

from pagedjax.core import SequenceStatus


def prompts(k: int, base_len: int = 3) -> dict[str, list[int]]:
    return {f"r{i}": [i + 1] + [2, 3, 4, 5, 6, 7, 8][: base_len - 1 + i % 5] for i in range(k)}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "srtf"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("caching", [False, True])
def test_preempted_runs_produce_unpreempted_outputs(mode, policy, chunked, caching):
    e = FakeEngine(
        num_gpu_blocks=12,
        block_size=4,
        preemption_mode=mode,
        policy=policy,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=32,
        enable_prefix_caching=caching,
    )
    ps = prompts(8)
    for rid, p in ps.items():
        e.add(rid, p, max_tokens=10)
    e.run()
    assert e.sched.num_preemptions_total > 0  # memory was actually tight
    for rid, p in ps.items():
        assert e.outputs_of(rid) == [reference_output(p, 10)]
    assert e.bm.get_num_free_gpu_blocks() == 12
    assert e.bm.get_num_free_cpu_blocks() == 64


def test_token_budget_and_whole_prompts_without_chunking():
    e = FakeEngine(max_num_batched_tokens=16)
    for i in range(3):
        e.add(f"r{i}", [i + 1] * 10, max_tokens=3)
    out = e.step()
    assert [s.request_id for s in out.scheduled] == ["r0"] and out.num_batched_tokens == 10
    out = e.step()  # decode of r0 + whole prompt of r1
    assert [len(s.token_ids) for s in out.scheduled] == [1, 10]
    e.run()


def test_max_num_seqs_limits_running():
    e = FakeEngine(max_num_seqs=2)
    for i in range(5):
        e.add(f"r{i}", [i + 1, 2], max_tokens=3)
    while e.sched.has_unfinished_seqs():
        out = e.step()
        assert len(out.scheduled) <= 2
        assert len(e.sched.running) <= 2


@pytest.mark.parametrize("chunked", [False, True])
def test_fan_out_slots_reserved_while_prompt_prefills(chunked):
    """A lone n=3 prompt samples 3 rows when its prefill ends: it holds 3 of the 4 sequence
    slots from its first chunk on, so a single-sample request waits rather than pushing the
    step's sampled rows to 5 (the step's shapes are sized for max_num_seqs rows)."""
    e = FakeEngine(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=chunked)
    e.add("fan", [1] * 8, max_tokens=3, n=3)
    e.add("a", [2, 3], max_tokens=3)
    e.add("b", [4, 5], max_tokens=3)
    first = e.step()
    assert [s.request_id for s in first.scheduled] == ["fan"]
    second = e.step()
    assert sorted(s.request_id for s in second.scheduled) == ["a", "fan"]  # 3 + 1 slots
    e.run()


def test_preemption_order_latest_arrival_first():
    # 3 requests, 1 block each for the prompt; decodes soon need more blocks than exist.
    e = FakeEngine(num_gpu_blocks=4, block_size=2, preemption_mode="recompute")
    for rid in "abc":
        e.add(rid, [ord(rid), 1], max_tokens=6)
    preempted = []
    while e.sched.has_unfinished_seqs():
        preempted += e.step().preempted
    assert preempted and preempted[0] == "c"
    # the earliest request is never the victim while a later one runs
    assert "a" not in preempted
    for rid in "abc":
        assert e.outputs_of(rid) == [reference_output([ord(rid), 1], 6)]


def test_recompute_resumes_as_one_prefill_of_prompt_plus_outputs():
    e = FakeEngine(num_gpu_blocks=4, block_size=2)
    for rid in "ab":
        e.add(rid, [ord(rid), 1], max_tokens=6)
    while not any(o.preempted for o in e.outputs) and e.sched.has_unfinished_seqs():
        e.step()
    victim = e.groups["b"].seqs[0]
    assert victim.num_computed_tokens == 0 and victim.status is SequenceStatus.WAITING
    n_out = victim.num_output_tokens
    assert n_out > 0
    while True:
        out = e.step()
        mine = [s for s in out.scheduled if s.request_id == "b"]
        if mine:
            assert mine[0].start_pos == 0 and len(mine[0].token_ids) == 2 + n_out
            break
    e.run()


def test_swapped_groups_return_before_new_admissions():
    e = FakeEngine(num_gpu_blocks=6, block_size=2, preemption_mode="swap")
    for rid in "abc":
        e.add(rid, [ord(rid), 1], max_tokens=8)
    swapped_seen = False
    late_added = False
    while e.sched.has_unfinished_seqs():
        had_swapped = bool(e.sched.swapped)
        before = {g.request_id for g in e.sched.running} | {g.request_id for g in e.sched.swapped}
        out = e.step()
        if out.blocks_to_swap_out:
            swapped_seen = True
            if not late_added:
                e.add("late", [9, 9], max_tokens=2)
                late_added = True
        if had_swapped and (e.sched.swapped or out.blocks_to_swap_out):
            # nothing new is admitted while any group is still swapped out
            assert {g.request_id for g in out.scheduled_groups} <= before
    assert swapped_seen
    for rid in "abc":
        assert e.outputs_of(rid) == [reference_output([ord(rid), 1], 8)]


def test_swap_falls_back_to_recompute_when_cpu_full():
    e = FakeEngine(num_gpu_blocks=4, num_cpu_blocks=0, block_size=2, preemption_mode="swap")
    for rid in "ab":
        e.add(rid, [ord(rid), 1], max_tokens=6)
    e.run()
    assert e.sched.num_preemptions_total > 0
    assert not any(o.blocks_to_swap_out for o in e.outputs)
    for rid in "ab":
        assert e.outputs_of(rid) == [reference_output([ord(rid), 1], 6)]


def test_impossible_requests_rejected_not_waiting_forever():
    e = FakeEngine(num_gpu_blocks=4, block_size=2, max_model_len=20, max_num_batched_tokens=9)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add("long", [1] * 21)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        e.add("budget", [1] * 10)
    with pytest.raises(ValueError, match="whole cache"):
        e.add("huge", [1] * 9)  # 5 blocks > 4
    e2 = FakeEngine(num_gpu_blocks=4, block_size=2, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="whole cache"):
        e2.add("huge", [1] * 9)
    e2.add("ok", [1] * 8, max_tokens=1)
    e2.run()


def test_dynamic_never_goes_to_rejected():
    e = FakeEngine(num_gpu_blocks=4, block_size=2, enable_prefix_caching=True)
    e.add("p", [7, 7, 7, 7], max_tokens=1)
    h = e.bm.register_prefix([7, 7, 7, 7])
    assert not h.complete  # nothing computed yet
    e.add("big", [1, 2, 3, 4, 5, 6], max_tokens=1)  # fits the cache at add time
    while e.sched.has_unfinished_seqs():
        e.step()
    assert h.complete  # pinned once "p" computed it: 2 of 4 blocks are now pinned
    assert [g.request_id for o in e.outputs for g in o.rejected] == ["big"]
    assert e.groups["big"].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    with pytest.raises(ValueError, match="whole cache"):
        e.add("big2", [1, 2, 3, 4, 5, 6], max_tokens=1)


def test_group_outgrowing_cache_is_rejected_not_livelocked():
    e = FakeEngine(num_gpu_blocks=6, block_size=2, preemption_mode="swap")
    e.add("b", [3, 4], max_tokens=20, n=2)
    e.step()
    _fork_after_prefill(e, "b", 2)
    e.run(max_steps=100)
    assert [g.request_id for o in e.outputs for g in o.rejected] == ["b"]
    assert e.bm.get_num_free_gpu_blocks() == 6 and e.bm.get_num_free_cpu_blocks() == 64


def test_chunked_prefill_splits_and_mixes_with_decodes():
    e = FakeEngine(enable_chunked_prefill=True, max_num_batched_tokens=8)
    e.add("short", [1, 2], max_tokens=10)
    e.step()
    long_prompt = list(range(1, 21))
    e.add("long", long_prompt, max_tokens=2)
    chunks = []
    while e.groups["long"].seqs[0].num_output_tokens == 0:
        out = e.step()
        kinds = {s.request_id: s for s in out.scheduled}
        assert out.num_batched_tokens <= 8
        if "long" in kinds:
            chunks.append(len(kinds["long"].token_ids))
            assert "short" in kinds and len(kinds["short"].token_ids) == 1
    assert sum(chunks) == 20 and len(chunks) >= 3 and max(chunks) == 7
    e.run()
    assert e.outputs_of("long") == [reference_output(long_prompt, 2)]


def test_oversized_recompute_is_chunked_even_without_chunked_prefill():
    e = FakeEngine(num_gpu_blocks=8, block_size=2, max_num_batched_tokens=7)
    e.add("a", [1] * 6, max_tokens=6)
    e.add("b", [2] * 6, max_tokens=6)
    e.run()
    assert e.sched.num_preemptions_total > 0
    assert e.outputs_of("b") == [reference_output([2] * 6, 6)]


def test_abort_anywhere_frees_blocks():
    e = FakeEngine(num_gpu_blocks=6, block_size=2, preemption_mode="swap")
    for rid in "abcd":
        e.add(rid, [ord(rid), 1], max_tokens=8)
    while not e.sched.swapped:
        e.step()
    w = e.add("w", [5, 5], max_tokens=2)  # waits: swapped groups pending
    for g in [e.sched.swapped[0], e.sched.running[0], w]:
        assert e.sched.abort_seq_group(g.request_id)
        assert g.seqs[0].status is SequenceStatus.FINISHED_ABORTED
        e.bm.check_invariants()
    assert not e.sched.abort_seq_group("nope")
    e.run()
    assert e.bm.get_num_free_gpu_blocks() == 6 and e.bm.get_num_free_cpu_blocks() == 64


def test_abort_between_schedule_and_update_is_safe():
    e = FakeEngine()
    e.add("a", [1, 2, 3])
    out = e.sched.schedule()
    e.sched.abort_seq_group("a")
    e.sched.update_after_step(out)
    e.bm.check_invariants()
    assert e.bm.get_num_free_gpu_blocks() == 64


def _fork_after_prefill(e: FakeEngine, rid: str, n: int):
    g = e.groups[rid]
    parent = g.seqs[0]
    for _ in range(n - 1):
        child = parent.fork(next(e.ids))
        e.sched.fork_seq(parent, child)
        g.add(child)
        e.seqs[child.seq_id] = child
    return g


def test_fork_children_share_prompt_blocks():
    e = FakeEngine(num_gpu_blocks=16, block_size=4)
    e.add("r", list(range(1, 7)), max_tokens=3, n=3)  # 6 tokens: 2 blocks, last half full
    e.step()  # prefill, samples first token for the parent
    g = _fork_after_prefill(e, "r", 3)
    assert e.bm.gpu.get_num_used() == 2
    out = e.step()
    assert len(out.scheduled) == 3 and len(out.blocks_to_copy) == 2
    assert e.bm.gpu.get_num_used() == 2 + 2  # prompt blocks once + one per extra child
    e.run()
    assert e.bm.get_num_free_gpu_blocks() == 16
    assert len(g.seqs) == 3


def test_multi_seq_group_preempted_whole_via_swap():
    e = FakeEngine(num_gpu_blocks=10, block_size=2, preemption_mode="recompute")
    e.add("a", [1, 2], max_tokens=6)
    e.add("b", [3, 4], max_tokens=6, n=2)
    e.step()
    _fork_after_prefill(e, "b", 2)
    while e.sched.has_unfinished_seqs():
        out = e.step()
        if "b" in out.preempted:
            assert out.blocks_to_swap_out  # multi-seq groups swap rather than recompute
            assert all(s.status is SequenceStatus.SWAPPED for s in e.groups["b"].seqs)
    assert e.sched.num_preemptions_total > 0
    ref = reference_output([3, 4], 6)
    assert e.outputs_of("b") == [ref, ref]  # fake sampler is deterministic


def test_srtf_short_requests_overtake_long_within_staging():
    e = FakeEngine(policy="srtf", staging_size=4, max_num_batched_tokens=16)
    e.add("long", list(range(1, 15)), max_tokens=2)
    for i in range(3):
        e.add(f"s{i}", [i + 1, 2], max_tokens=2)
    out = e.step()
    order = [s.request_id for s in out.scheduled]
    assert order[:3] == ["s0", "s1", "s2"] and "long" not in order
    e.run()
    assert e.first_token_at["long"] > max(e.first_token_at[f"s{i}"] for i in range(3))


def test_fcfs_keeps_arrival_order():
    e = FakeEngine(policy="fcfs", max_num_batched_tokens=15)
    e.add("long", list(range(1, 15)), max_tokens=2)
    e.add("s0", [1, 2], max_tokens=2)
    assert [s.request_id for s in e.step().scheduled] == ["long"]


@pytest.mark.parametrize("chunked", [False, True])
def test_srtf_long_request_not_starved_by_stream_of_short_ones(chunked):
    staging = 4
    e = FakeEngine(
        policy="srtf",
        staging_size=staging,
        max_num_batched_tokens=16,
        enable_chunked_prefill=chunked,
        num_gpu_blocks=256,
    )
    for i in range(staging - 1):
        e.add(f"pre{i}", [1, 2], max_tokens=3)
    e.add("long", list(range(1, 15)), max_tokens=3)
    k = 0
    for _ in range(60):  # two fresh short requests arrive every step
        for _ in range(2):
            e.add(f"s{k}", [k % 50 + 1, 2], max_tokens=3)
            k += 1
        e.step()
        if "long" in e.finished_at:
            break
    # bounded by the staging batch it joined, not by the arrival stream
    assert "long" in e.finished_at and e.finished_at["long"] <= 12


def test_stats():
    e = FakeEngine(num_gpu_blocks=4, block_size=2)
    for rid in "abc":
        e.add(rid, [ord(rid), 1], max_tokens=6)
    e.step()
    s = e.sched.get_stats()
    assert s.num_running + s.num_waiting + s.num_swapped == 3
    assert 0 < s.kv_cache_usage <= 1
    e.run()
    s = e.sched.get_stats()
    assert s.num_preemptions_total == e.sched.num_preemptions_total > 0
    assert s.num_running == s.num_waiting == 0 and s.kv_cache_usage == 0


def test_schedule_is_linear_in_running():
    """Operation-count proxy for host overhead: no per-step quadratic work."""
    e = FakeEngine(num_gpu_blocks=4096, block_size=16, max_num_batched_tokens=8192)
    for i in range(256):
        e.add(f"r{i}", [i + 1] * 20, max_tokens=10**6)
    e.step()
    for _ in range(3):
        out = e.step()
        assert len(out.scheduled) == 256 and out.num_batched_tokens == 256


def test_recompute_all_forgets_kv_and_refuses_forked_groups():
    """Weight swap: single-sequence groups go back to waiting with no KV and finish with the
    same tokens; a forked group in flight makes it raise before anything changes."""
    e = FakeEngine(num_gpu_blocks=16, block_size=4)
    e.add("a", [1, 2, 3], max_tokens=6)
    e.add("b", list(range(5, 14)), max_tokens=6)
    e.step()
    e.step()
    assert sorted(e.sched.recompute_all()) == ["a", "b"]
    assert e.bm.get_num_free_gpu_blocks() == 16 and not e.sched.running
    assert all(s.num_computed_tokens == 0 for g in e.sched.waiting for s in g.seqs)
    e.run()
    assert e.outputs_of("a") == [reference_output([1, 2, 3], 6)]
    assert e.outputs_of("b") == [reference_output(list(range(5, 14)), 6)]
    e.add("r", list(range(1, 7)), max_tokens=3, n=3)
    e.step()
    _fork_after_prefill(e, "r", 3)
    used = e.bm.gpu.get_num_used()
    with pytest.raises(ValueError, match="params"):
        e.sched.recompute_all()
    assert e.bm.gpu.get_num_used() == used and len(e.sched.running) == 1
    e.run()
    assert e.bm.get_num_free_gpu_blocks() == 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "srtf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exceptions_while_scheduling_fail_only_their_group(mode, policy, seed):
    """The KV manager raises for a few doomed requests at random moments (admission, growth,
    swap out, swap in) under memory pressure: exactly those are reported in `failed`, once;
    every other request still produces its reference output, and the pool ends whole."""
    import random

    rng = random.Random(seed)
    e = FakeEngine(num_gpu_blocks=12, block_size=4, preemption_mode=mode, policy=policy,
                   max_num_batched_tokens=32)
    ps = prompts(10)
    doomed = set(rng.sample(sorted(ps), 3))
    for rid, p in ps.items():
        e.add(rid, p, max_tokens=10)
    owner = {s.seq_id: rid for rid, g in e.groups.items() for s in g.seqs}
    bm = e.bm

    def faulty(method, rid_of):
        def call(arg, *rest):
            if rid_of(arg) in doomed and rng.random() < 0.3:
                raise RuntimeError(f"injected fault in {method.__name__}")
            return method(arg, *rest)
        return call

    by_group = lambda g: g.request_id
    by_seq = lambda s: owner.get(s.seq_id)
    bm.allocate = faulty(bm.allocate, by_group)
    bm.append_slots = faulty(bm.append_slots, by_seq)
    bm.decode_slot = faulty(bm.decode_slot, by_seq)  # the decode fast path's growth
    bm.swap_out = faulty(bm.swap_out, by_group)
    bm.swap_in = faulty(bm.swap_in, by_group)
    e.run()
    assert e.failed <= doomed and e.failed  # some doomed request did hit its fault
    for rid, p in ps.items():
        if rid not in e.failed:
            assert e.outputs_of(rid) == [reference_output(p, 10)], rid
    assert e.bm.get_num_free_gpu_blocks() == 12
    assert e.bm.get_num_free_cpu_blocks() == 64


def test_a_group_failing_halfway_keeps_the_step_sequences_aligned():
    """A two-sequence group whose second sequence's slots raise after its first was emitted:
    `_fail_group` drops the group's entries, and the step's own sequence list
    (`SchedulerOutput.advance` and `publish`, which `update_after_step` walks) keeps none of
    the failed group's sequences."""
    e = FakeEngine(num_gpu_blocks=16, block_size=4)
    e.add("ok", [1, 2, 3], max_tokens=6)
    g = e.add("forked", [4, 5, 6, 7, 8], max_tokens=6)
    e.step()  # both prompts computed, one token each
    parent = g.seqs[0]
    child = parent.fork(999)
    e.sched.fork_seq(parent, child)
    g.add(child)
    e.seqs[child.seq_id] = child
    real = e.bm.append_slots

    def append_slots(seq, n):
        if seq.seq_id == child.seq_id:
            raise RuntimeError("injected fault")
        return real(seq, n)

    e.bm.append_slots = append_slots
    out = e.sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["ok"]
    walked = {q.seq_id for q, _ in out.advance + out.publish}
    assert not walked & {parent.seq_id, child.seq_id}
    assert [x.request_id for x, _ in out.failed] == ["forked"]
    e.sched.update_after_step(out)  # walks `advance`: must not raise
    assert e.seqs[out.scheduled[0].seq_id].num_computed_tokens == 4
