"""Fake engine + fake KV store for scheduler tests.

The fake runner stores, for every written KV slot, the exact token prefix that
produced it, and before each step checks that every slot the sequence attends
to holds its own prefix. Any bug in block tables, copy-on-write, swapping or
prefix-cache reuse therefore shows up as a wrong "attention input".
"""

from __future__ import annotations

import itertools

import numpy as np

from pagedjax.core import (
    BlockManager,
    SampledToken,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedjax.worker.input_batch import InputBatch


def next_token(tokens: list[int]) -> int:
    """Deterministic in the content only, so preemption cannot change outputs."""
    return (sum(tokens) * 7 + len(tokens) * 13) % 97 + 3


class FakeEngine:
    def __init__(
        self,
        *,
        num_gpu_blocks: int = 64,
        num_cpu_blocks: int = 64,
        block_size: int = 4,
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
        **cfg,
    ) -> None:
        cfg.setdefault("max_model_len", 1024)
        self.bm = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, watermark, enable_prefix_caching)
        self.sched = Scheduler(SchedulerConfig(**cfg), self.bm)
        self.bs = block_size
        self.gpu: dict[int, dict[int, tuple]] = {}
        self.cpu: dict[int, dict[int, tuple]] = {}
        self.seqs: dict[int, Sequence] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self.ids = itertools.count()
        self.clock = itertools.count()
        self.steps = 0
        self.finished_at: dict[str, int] = {}
        self.first_token_at: dict[str, int] = {}
        self.outputs: list[SchedulerOutput] = []
        self.failed: set[str] = set()  # groups whose scheduling raised (SchedulerOutput.failed)
        # The runner's persistent block tables, checked against the live tables every step;
        # few rows and only every other finished group released, so rows are swept and reused.
        self.batch = InputBatch(-(-cfg["max_model_len"] // block_size) + 1, max_rows=8)
        # The same rows kept on a (simulated) device by deltas: `mirror` gets only what
        # `take_deltas` hands over, taken every other step (a dropped step's writes wait for
        # the next), and is lost and rebuilt every 7th step (`invalidate`).
        self.dbatch = InputBatch(self.batch.max_blocks_per_seq, max_rows=8, device_tables=True)
        self.mirror = np.zeros((8 + self.sched.config.max_num_seqs, 1,
                                self.batch.max_blocks_per_seq), np.int32)

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1, **kw):
        seq = Sequence(next(self.ids), prompt)
        g = SequenceGroup(rid, [seq], arrival_time=float(next(self.clock)), max_tokens=max_tokens, n=n, **kw)
        self.sched.add_seq_group(g)
        self.seqs[seq.seq_id] = seq
        self.groups[rid] = g
        return g

    def _copy(self, src_store, dst_store, pairs) -> None:
        snap = {s: dict(src_store.get(s, {})) for s, _ in pairs}
        for s, d in pairs:
            dst_store[d] = dict(snap[s])

    def step(self) -> SchedulerOutput:
        # The decode fast path advances its sequences when it schedules them: each entry's
        # start is checked against the length computed before the step.
        computed = {sid: q.num_computed_tokens for sid, q in self.seqs.items()}
        out = self.sched.schedule()
        self.outputs.append(out)
        budget = self.sched.config.max_num_batched_tokens
        assert out.num_batched_tokens <= budget
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert len(out.scheduled) <= self.sched.config.max_num_seqs
        # Sampled rows, counting the n rows a lone n>1 prompt fans out into, fit too.
        assert sum(max(g.max_num_running_seqs(), 1) for g in out.scheduled_groups) \
            <= self.sched.config.max_num_seqs
        self._copy(self.gpu, self.cpu, out.blocks_to_swap_out)
        self._copy(self.cpu, self.gpu, out.blocks_to_swap_in)
        self._copy(self.gpu, self.gpu, out.blocks_to_copy)
        bs = self.bs
        for s in out.scheduled:
            seq = self.seqs[s.seq_id]
            toks = seq.get_token_ids()
            # (or, admitted this step, where the prefix cache left it)
            assert s.start_pos == computed[s.seq_id] or computed[s.seq_id] == 0, \
                (s, computed[s.seq_id])
            assert s.token_ids == toks[s.start_pos : s.start_pos + len(s.token_ids)]
            assert len(s.block_table) * bs >= s.start_pos + len(s.token_ids)
            for p in range(s.start_pos):  # attention reads
                got = self.gpu.get(s.block_table[p // bs], {}).get(p % bs)
                assert got == tuple(toks[: p + 1]), f"seq {s.seq_id} pos {p}: bad KV"
            for i in range(len(s.token_ids)):  # KV writes
                p = s.start_pos + i
                self.gpu.setdefault(s.block_table[p // bs], {})[p % bs] = tuple(toks[: p + 1])
            assert s.needs_logits == (s.start_pos + len(s.token_ids) == len(toks))
        if out.scheduled:
            width = max(len(s.block_table) for s in out.scheduled)
            got = self.batch.block_tables(out.scheduled, len(out.scheduled) + 1, width)
            want = np.zeros_like(got)
            for i, s in enumerate(out.scheduled):
                want[i, : len(s.block_table)] = s.block_table
            assert (got == want).all(), "persistent block tables differ from the live tables"
            rows = self.dbatch.rows(out.scheduled)
            if self.steps % 2 == 0:
                idx, val = self.dbatch.take_deltas()
                assert len(np.unique(idx)) == len(idx)
                self.mirror.reshape(-1)[idx] = val  # an index past the end would raise
                for r, s in zip(rows, out.scheduled, strict=True):
                    assert (self.mirror[r, 0, : len(s.block_table)] == s.block_table).all(), \
                        "device block tables differ from the live tables"
                    assert (self.mirror[r] == self.dbatch.host_tables[r]).all()
            if self.steps % 7 == 6:  # the device copy is lost: zeros, every row rewritten
                self.mirror[:] = 0
                self.dbatch.invalidate()
        self.sched.update_after_step(out)
        for s in out.scheduled:  # every entry advanced by its tokens, whichever path took it
            seq = self.seqs[s.seq_id]
            assert seq.num_computed_tokens == s.start_pos + len(s.token_ids), s
        sampled = []
        for s in out.scheduled:
            if not s.needs_logits:
                continue
            seq = self.seqs[s.seq_id]
            sampled.append(SampledToken(s.request_id, seq, next_token(seq.get_token_ids()), 0.0))
            self.first_token_at.setdefault(s.request_id, self.steps)
        # The scheduler owns request state: it appends the tokens and finishes by length.
        for a in self.sched.update_from_output(sampled, lambda: next(self.ids)):
            if a.seq.num_output_tokens >= a.group.max_tokens:
                assert a.seq.status is SequenceStatus.FINISHED_LENGTH
        for g in self.sched.free_finished_seq_groups():
            self.finished_at[g.request_id] = self.steps
            if len(self.finished_at) % 2:
                self.batch.release(s.seq_id for s in g.seqs)
                self.dbatch.release(s.seq_id for s in g.seqs)
        for g in out.rejected:
            self.finished_at[g.request_id] = self.steps
        for g, _error in out.failed:
            assert g.request_id not in self.failed, "a group failed twice"
            self.failed.add(g.request_id)
            self.finished_at[g.request_id] = self.steps
        self.bm.check_invariants()
        self.steps += 1
        return out

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished_seqs():
            self.step()
            assert self.steps < max_steps, "did not finish"
        self.bm.check_invariants()

    def outputs_of(self, rid: str) -> list[list[int]]:
        return [s.output_token_ids for s in self.groups[rid].seqs]


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(toks)
        toks.append(t)
        out.append(t)
    return out
