"""Block tables kept on the device and updated by deltas (`pagedjax/worker/device_tables.py`):
the engine's outputs are those of the engine that ships every step's tables, under
preemption by swap and recompute, prefix-cache hits, chunked prefill, n > 1, beams and async
scheduling; writes a step cannot carry go first in `write` calls; a dispatch that fails after
taking the queue resets the table and has every row sent whole again; rows queue only the
entries that changed; and the serving step gathers the same tables the host would have sent.
The row bookkeeping itself is checked against the live tables at every step of the scheduler
property tests (tests/core/core_sim.py)."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.worker import device_tables as dt
from pagedjax.worker.input_batch import InputBatch
from pagedjax.worker.step_inputs import build_step_inputs
from tests.engine.test_async_scheduling import _key, _logprobs, _params
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=11).get)


def _run(config, params, device_tables: bool, mode: str, prefix_caching: bool, seed: int,
         async_scheduling: bool = True):
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=28, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, enable_prefix_caching=prefix_caching,
                          enable_chunked_prefill=True, swap_space_gb=0.01,
                          async_scheduling=async_scheduling, device_block_tables=device_tables)
    engine = llm.engine
    assert engine.input_batch.device_tables is device_tables
    assert (engine.runner.device_tables is not None) is device_tables
    writes = []
    if device_tables:
        tables = engine.runner.device_tables
        real = tables.write

        def spy(array, idx, val):
            writes.append(int((np.asarray(idx) < tables.size).sum()))
            return real(array, idx, val)

        tables.write = spy
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, config.vocab_size, 40)]
    requests = []
    for i in range(40):
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(1, 60)))]
        if i % 3 == 0:  # a cached prefix of 5 blocks: more entries than a small step carries
            prompt = shared + prompt[:20]
        requests.append((f"r{i}", prompt, _params(rng, prefix_caching)))
    return serve_randomly(engine, requests, seed + 1), writes, engine.get_stats()


def serve_randomly(engine, requests: list, plan_seed: int) -> dict:
    """Add ``requests`` (id, prompt ids, params) 0-3 at a time between steps until all are
    finished; returns the finished outputs by id, after checking the block pool is whole."""
    plan = np.random.default_rng(plan_seed)
    outputs, pending = {}, list(requests)
    while pending or engine.has_unfinished_requests():
        for _ in range(int(plan.integers(0, 4))):
            if pending:
                rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, None, sp, prompt_token_ids=prompt)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return outputs


@pytest.mark.parametrize("mode,prefix_caching,seed,async_scheduling",
                         [("swap", True, 0, True), ("recompute", True, 1, True),
                          ("recompute", False, 2, False)])
def test_device_tables_equal_host_tables(tiny, mode, prefix_caching, seed, async_scheduling):
    config, params = tiny
    host, _, st_host = _run(config, params, False, mode, prefix_caching, seed, async_scheduling)
    dev, writes, st_dev = _run(config, params, True, mode, prefix_caching, seed,
                               async_scheduling)
    assert st_host.num_preemptions_total > 0 and st_dev.num_preemptions_total > 0
    assert set(host) == set(dev) and len(host) == 40
    for rid in host:  # same batches, same tables: the same bits
        assert _key(dev[rid]) == _key(host[rid]), rid
        np.testing.assert_array_equal(_logprobs(dev[rid]), _logprobs(host[rid]))
    if prefix_caching:
        assert writes and max(writes) > 0, "no step overflowed into `write`"


def test_failed_dispatch_rewrites_every_row(tiny, monkeypatch):
    """A step that fails after taking the batch's queued writes must not leave the device
    copy behind the host rows: the batch rewrites each row on its next use."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, max_model_len=128, async_scheduling=False)
    runner, batch = llm.engine.runner, llm.engine.input_batch
    sched = [ScheduledSeq(0, "a", [5, 6, 7], 0, [3, 4], True, 1),
             ScheduledSeq(1, "b", [8], 8, [9, 2], True, 1)]
    inputs = build_step_inputs(sched, 8, runner.max_blocks_per_seq, plan=runner.shape_plan,
                               batch=batch)
    real = runner._serve_step

    def boom(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "_serve_step", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        runner.execute(inputs)
    monkeypatch.setattr(runner, "_serve_step", real)
    assert batch.take_deltas()[0].size == 0  # the failed step took the queue ...
    rewrites = batch.num_rewrites
    again = build_step_inputs(sched, 8, runner.max_blocks_per_seq, plan=runner.shape_plan,
                              batch=batch)
    assert batch.num_rewrites == rewrites + 2  # ... so both rows are queued whole again
    runner.execute(again)
    rows = again.table_rows[:2]
    got = np.asarray(runner.device_tables.array)[rows, 0, :2]
    np.testing.assert_array_equal(got, [[3, 4], [9, 2]])


def test_step_parts_spill_into_writes_and_pad_the_rest():
    import jax

    tables = dt.DeviceTables(6, 1, 4, jax.devices("cpu")[0])
    idx = np.arange(20, dtype=np.int32)
    val = np.arange(100, 120, dtype=np.int32)
    rows, step_idx, step_val = tables.step_parts(np.array([1, 0], np.int32), idx, val, 8)
    assert list(rows) == [1, 0]
    # 12 entries went ahead in one `write`; the step carries the last 8, unpadded
    np.testing.assert_array_equal(np.asarray(tables.array).reshape(-1)[:12], val[:12])
    np.testing.assert_array_equal(step_idx, idx[12:])
    applied = dt.apply_writes(tables.array, step_idx, step_val)
    np.testing.assert_array_equal(np.asarray(applied).reshape(-1)[:20], val)
    _, pad_idx, _ = tables.step_parts(np.array([2], np.int32), idx[:3], val[:3], 8)
    assert list(pad_idx[3:]) == [tables.size] * 5  # past the end: dropped by the scatter
    with pytest.raises(RuntimeError, match="past the device table"):
        tables.step_parts(np.array([6], np.int32), idx[:0], val[:0], 8)


def test_gather_rows_matches_the_host_tables():
    """The serving step's tables (`gather_rows`) equal `InputBatch.block_tables`, one group
    and several."""
    rng = np.random.default_rng(3)
    for groups in (1, 2):
        host = InputBatch(6, num_groups=groups)
        dev = InputBatch(6, num_groups=groups, device_tables=True)
        mirror = np.zeros((16, groups, 6), np.int32)
        for step in range(12):
            sched = []
            for sid in rng.choice(10, size=int(rng.integers(1, 5)), replace=False):
                tabs = tuple([int(b) for b in rng.integers(1, 50, int(rng.integers(0, 7)))]
                             for _ in range(groups))
                sched.append(ScheduledSeq(int(sid), "r", [0], 0,
                                          tabs if groups > 1 else tabs[0], True,
                                          (-1,) * groups if groups > 1 else -1))
            want = host.block_tables(sched, 5, 6)
            rows = np.zeros(5, np.int32)
            rows[: len(sched)] = dev.rows(sched)
            idx, val = dev.take_deltas()
            mirror.reshape(-1)[idx] = val
            got = np.asarray(dt.gather_rows(mirror, rows, 6))
            got[..., len(sched):, :] = 0  # padding rows: any row (their lengths are 0)
            np.testing.assert_array_equal(got, want, err_msg=f"groups {groups} step {step}")


def test_unversioned_rows_send_what_changed_and_invalidate_sends_all():
    """An unversioned table (the contiguous baselines: version -1, rewritten every step)
    that only grew queues its new entries only; a replaced row queues what differs, the
    stale tail's zeros included; after `invalidate` (the device copy is zeros) a row queues
    every entry it holds, once."""
    batch = InputBatch(8, device_tables=True)
    seq = lambda table: ScheduledSeq(0, "r", [0], 0, table, True, -1)  # noqa: E731
    (r,) = batch.rows([seq([4, 5])])
    base = r * 8
    idx, val = batch.take_deltas()
    assert list(idx) == [base, base + 1] and list(val) == [4, 5]
    batch.rows([seq([4, 5, 6])])
    idx, val = batch.take_deltas()
    assert list(idx) == [base + 2] and list(val) == [6]
    batch.rows([seq([4, 9])])  # a different table, shorter: one changed id, one zeroed
    idx, val = batch.take_deltas()
    assert list(idx) == [base + 1, base + 2] and list(val) == [9, 0]
    batch.invalidate()
    batch.rows([seq([4, 9])])
    idx, val = batch.take_deltas()
    assert list(idx) == [base, base + 1] and list(val) == [4, 9]  # past it: zeros already
    batch.rows([seq([4, 9])])
    assert batch.take_deltas()[0].size == 0
