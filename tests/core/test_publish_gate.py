"""`Sequence.publish_at`, the scheduler's gate on `BlockManager.mark_blocks_computed`, only
skips calls that would publish nothing: random workloads with shared prefixes (prefix hits,
forks, preemption by swap and recompute, chunked prefill) give the same steps, block for
block, and the same prefix cache with the gate and with every call made; and at every step a
skipped call, made anyway, publishes no block."""

from __future__ import annotations

import pytest
from core_sim import FakeEngine
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import Scheduler
from pagedjax.core.block_manager import BlockManager


def _run(requests, cfg, gate: bool, batched: bool = True) -> tuple[list, dict, list, int]:
    """``batched``: a step's blocks published in one call (`BlockManager.publish_computed`),
    else one `mark_blocks_computed` call per sequence."""
    real_mark = BlockManager.mark_blocks_computed
    real_publish = BlockManager._publish
    real_after = Scheduler.update_after_step
    skipped = 0

    def ungated(self, pairs):
        """Both publishing calls go through `_publish`."""
        pairs = list(pairs)
        real_publish(self, pairs)
        for seq, _ in pairs:
            seq.publish_at = 0  # every later step calls it again

    def checked(self, out):
        """After the step: every call the gate skips would have published nothing."""
        nonlocal skipped
        real_after(self, out)
        bm = self.bm
        for seq in (e.seqs[s.seq_id] for s in out.scheduled):
            blocks = bm._seqs.get(seq.seq_id)
            m = min(seq.num_computed_tokens, seq.num_total_tokens)
            if blocks is None or seq.status.is_finished or m >= seq.publish_at:
                continue
            skipped += 1
            before = len(blocks.chain)
            real_mark(bm, seq, m)
            assert len(blocks.chain) == before, f"seq {seq.seq_id}: the gate hid a full block"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "update_after_step", checked)
        if not gate:
            mp.setattr(BlockManager, "_publish", ungated)
        if not batched:
            mp.setattr(BlockManager, "publish_computed", None)
        e = FakeEngine(**cfg)
        pending = list(requests)
        traces = []
        while pending or e.sched.has_unfinished_seqs():
            if pending and e.steps % 2 == 0:
                rid, prompt, max_tokens, n = pending.pop(0)
                try:
                    e.add(rid, prompt, max_tokens=max_tokens, n=n)
                except ValueError:
                    pass
            out = e.step()
            traces.append(tuple((s.seq_id, s.start_pos, tuple(s.block_table))
                                for s in out.scheduled) + (tuple(out.preempted),))
            assert e.steps < 3000
        e.bm.check_invariants()
        assert e.bm.gpu.get_num_free() == e.bm.num_gpu_blocks
        cached = sorted(repr((key, e.bm.gpu.block_of(serial)))
                        for key, serial in e.bm.gpu._cached.items())
        return traces, {rid: e.outputs_of(rid) for rid in e.groups}, cached, skipped


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 12),
                            st.sampled_from([1, 1, 2])), min_size=1, max_size=8),
    blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
)
def test_same_steps_and_cache_with_and_without_the_gate(reqs, blocks, block_size, mode, chunked):
    # Three shared prefixes, each request a prefix plus a tail of its own: prefix hits.
    heads = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5], [4, 4, 4]]
    requests = [(f"r{i}", heads[h] + [(5 * i + j) % 13 + 1 for j in range(t)], m, n)
                for i, (h, t, m, n) in enumerate(reqs)]
    cfg = dict(num_gpu_blocks=blocks, num_cpu_blocks=blocks, block_size=block_size,
               preemption_mode=mode, enable_prefix_caching=True, enable_chunked_prefill=chunked,
               max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64)
    gated = _run(requests, cfg, True)
    every = _run(requests, cfg, False)
    one_by_one = _run(requests, cfg, True, batched=False)
    assert gated[:3] == every[:3]
    assert one_by_one == gated  # the batched publish is the calls it stands for
    assert every[3] == 0  # the ungated run never skips


def test_the_gate_skips_most_decode_steps():
    """A decoding sequence is marked once per block, not once per token."""
    requests = [(f"r{i}", list(range(1, 6 + i)), 24, 1) for i in range(3)]
    cfg = dict(num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64,
               enable_prefix_caching=True)
    _, _, _, skipped = _run(requests, cfg, True)
    decode_steps = 3 * 23
    assert skipped >= decode_steps * 3 // 4 - 3  # 3 of every 4 tokens leave a block open
