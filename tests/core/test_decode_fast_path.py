"""`Scheduler._decode_run` (with `BlockManager.decode_slot`) and `Scheduler._steady_step`
are only shortcuts: random workloads scheduled with both, with the decode run alone and with
neither give the same steps, block for block (tables, versions, copies, swaps, preemptions),
and the same outputs; and they do run."""

from __future__ import annotations

import pytest
from core_sim import FakeEngine, reference_output
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import Scheduler
from pagedjax.core import scheduler as scheduler_module


def _trace(out, versions: dict) -> tuple:
    """A step as comparable data; table versions (from a process-wide counter) by the order
    in which the run first saw them."""
    return (tuple((s.seq_id, tuple(s.token_ids), s.start_pos, tuple(s.block_table),
                   versions.setdefault(s.table_version, len(versions)), s.needs_logits)
                  for s in out.scheduled),
            tuple(out.blocks_to_copy), tuple(out.blocks_to_swap_out),
            tuple(out.blocks_to_swap_in), tuple(out.preempted), out.num_batched_tokens)


def _run(requests, cfg, fast: bool, steady: bool | None = None,
         columns: bool = False) -> tuple[list, dict, int]:
    """``fast``: the decode run on; ``steady`` (default: as ``fast``): steady steps on;
    ``columns``: the finished scan reads a steady cohort's statuses by `map` down to one
    sequence (`scheduler.COLUMNS_MIN`, 16 in the engine). Returns the traces, the outputs,
    and how many entries the shortcuts scheduled."""
    taken = 0
    real, real_steady = Scheduler._decode_run, Scheduler._steady_step
    steady = fast if steady is None else steady

    def counted(self, st_, queue, keep):
        nonlocal taken
        if fast:
            before = len(queue)
            try:
                real(self, st_, queue, keep)
            finally:
                taken += before - len(queue)

    def counted_steady(self, st_):
        nonlocal taken
        if not steady or not real_steady(self, st_):
            return False
        taken += len(st_.out.steady.starts)
        return True

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Scheduler, "_decode_run", counted)
        m.setattr(Scheduler, "_steady_step", counted_steady)
        if columns:
            m.setattr(scheduler_module, "COLUMNS_MIN", 1)
        e = FakeEngine(**cfg)
        pending = list(requests)
        traces, versions = [], {}
        while pending or e.sched.has_unfinished_seqs():
            if pending and e.steps % 2 == 0:  # arrivals spread over the run
                rid, prompt, max_tokens, n = pending.pop(0)
                try:
                    e.add(rid, prompt, max_tokens=max_tokens, n=n)
                except ValueError:  # can never fit this cache: refused the same either way
                    pass
            traces.append(_trace(e.step(), versions))
            assert e.steps < 3000
        e.bm.check_invariants()
        assert e.bm.gpu.get_num_free() == e.bm.num_gpu_blocks  # the pool is whole
        return traces, {rid: e.outputs_of(rid) for rid in e.groups}, taken


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 12), st.sampled_from([1, 1, 1, 2])),
                  min_size=1, max_size=9),
    blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["recompute", "swap"]),
    prefix=st.booleans(),
    chunked=st.booleans(),
)
def test_same_steps_with_and_without_the_fast_path(reqs, blocks, block_size, mode,
                                                   prefix, chunked):
    requests = [(f"r{i}", [(7 * i + j) % 11 + 1 for j in range(p)], m, n)
                for i, (p, m, n) in enumerate(reqs)]
    cfg = dict(num_gpu_blocks=blocks, num_cpu_blocks=blocks, block_size=block_size,
               preemption_mode=mode, enable_prefix_caching=prefix,
               enable_chunked_prefill=chunked, max_num_batched_tokens=16, max_num_seqs=6,
               max_model_len=64)
    fast_trace, fast_out, taken = _run(requests, cfg, True)
    col_trace, col_out, _ = _run(requests, cfg, True, columns=True)
    run_trace, run_out, _ = _run(requests, cfg, True, steady=False)
    slow_trace, slow_out, none = _run(requests, cfg, False)
    assert none == 0
    assert fast_trace == slow_trace
    assert fast_out == slow_out
    assert col_trace == slow_trace
    assert col_out == slow_out
    assert run_trace == slow_trace
    assert run_out == slow_out


def test_the_fast_path_runs_and_opens_blocks():
    """Decoding lone sequences take it, including on the steps that open a block."""
    requests = [(f"r{i}", list(range(1, 4 + i)), 9, 1) for i in range(3)]
    cfg = dict(num_gpu_blocks=32, block_size=2, max_num_seqs=4, max_model_len=64)
    traces, outs, taken = _run(requests, cfg, True)
    decode_steps = sum(len(t[0]) for t in traces) - len(requests)  # one prefill each
    assert taken == decode_steps  # room everywhere: every decode took it
    for rid, prompt, max_tokens, _ in requests:
        assert outs[rid] == [reference_output(prompt, max_tokens)]


def test_steady_steps_run_and_stop_at_any_change():
    """Three sequences decode side by side: once all three decode, each step is the last
    step's cohort again (`Scheduler._steady_step`); when one finishes the cohort is cut down
    to the two left and goes on; a new request (a prefill, then its first decode) takes the
    general path for two steps, and then the three decoding form a cohort of their own."""
    e = FakeEngine(num_gpu_blocks=32, block_size=2, max_num_seqs=4, max_model_len=64)
    for i, m in enumerate((6, 12, 12)):
        e.add(f"r{i}", [1, 2, 3 + i], max_tokens=m)
    steady = []
    while e.sched.has_unfinished_seqs():
        if e.steps == 8:
            e.add("late", [4, 5], max_tokens=5)
        out = e.step()
        steady.append(None if out.steady is None else len(out.steady.starts))
    # Step 0 prefills all three (their first token); step 1 is their first decode
    # (general); r0 ends with its 6th token (step 5's) and steps 6-7 run the two left, cut
    # down; step 8 prefills "late" beside r1 and r2's decodes, step 9 is its first decode;
    # steps 10-11 are steady (r1 and r2 end with their 12th token, step 11's), and step 12
    # runs "late" alone, cut down again, for its 5th token.
    assert steady == [None, None, 3, 3, 3, 3, 2, 2, None, None, 3, 3, 1], steady
    assert e.sched.num_steady_cuts == 2
    for i, m in enumerate((6, 12, 12)):
        assert e.outputs_of(f"r{i}") == [reference_output([1, 2, 3 + i], m)]
    assert e.outputs_of("late") == [reference_output([4, 5], 5)]
    assert e.bm.gpu.get_num_free() == e.bm.num_gpu_blocks
