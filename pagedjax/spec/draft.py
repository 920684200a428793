"""Draft-model proposer: a smaller model of the same tokenizer guesses the next k tokens.

The draft runs in its own `ModelRunner` with its own paged KV cache and block pool (the
target's block manager never sees it). Before the scheduler plans a step, the engine calls
`prepare` with every decoding sequence; the draft then runs k forward passes batched over
those sequences: one that catches up on the tokens it has not seen (the prompt the first
time, afterwards the tokens the target accepted last step) and yields draft 1, then k - 1
single-token steps, each feeding the previous draft. Drafts are greedy (the argmax), so the
proposal is a point mass and `pagedjax.spec.verify`'s acceptance rule is exact.

The draft's cache holds the tokens it was fed; on the next call only the longest prefix that
still equals the sequence's tokens is kept (rejected drafts' slots are simply rewritten), so
preemption, recompute and rejected drafts need no bookkeeping between the two models. A
sequence the draft pool cannot hold gets no drafts (speculation never blocks decoding).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.worker.step_inputs import build_step_inputs


class _DraftSeq:
    __slots__ = ("fed", "blocks", "drafts", "context")

    def __init__(self) -> None:
        self.fed: list[int] = []  # tokens whose KV the draft cache holds, in order
        self.blocks: list[int] = []
        self.drafts: list[int] = []  # the last proposal
        self.context = -1  # sequence length the proposal follows


class DraftModelProposer:
    def __init__(self, runner, k: int) -> None:
        """``runner``: the draft's `ModelRunner` (its own cache of ``runner.num_gpu_blocks``
        blocks); ``k``: drafts per step."""
        self.runner = runner
        self.k = k
        self.block_size = runner.block_size
        self.pool = BlockPool(runner.num_gpu_blocks)
        self.budget = runner.engine_config.max_num_batched_tokens
        self.max_blocks = runner.max_blocks_per_seq
        self._seqs: dict[int, _DraftSeq] = {}

    # -- the scheduler's interface ----------------------------------------------
    def propose_for(self, seq, k: int) -> list[int]:
        st = self._seqs.get(seq.seq_id)
        if st is None or st.context != seq.num_total_tokens:
            return []  # not prepared for this context
        return st.drafts[:k]

    def release(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            st = self._seqs.pop(sid, None)
            if st is not None:
                for b in reversed(st.blocks):
                    self.pool.decref(b)

    # -- drafting ---------------------------------------------------------------
    def prepare(self, seqs: list) -> None:
        """Draft k tokens for each of ``seqs`` (decoding sequences), batched: one catch-up
        pass, then k - 1 single-token passes. Drafts follow the known tokens; where a
        sequence's last token is still on the device (async scheduling) the scheduler takes
        the first draft as a guess of it, so then one more is drafted (k + 1)."""
        k = self.k + any(seq.num_pending for seq in seqs)
        # Sequences not decoding now (finished, aborted, preempted) give their blocks back; a
        # preempted one catches up again when it returns.
        live = {seq.seq_id for seq in seqs}
        self.release([sid for sid in self._seqs if sid not in live])
        work: list[tuple[object, _DraftSeq, list[int]]] = []
        for seq in seqs:
            tokens = seq.get_token_slice(0, seq.num_total_tokens)
            st = self._seqs.setdefault(seq.seq_id, _DraftSeq())
            st.drafts, st.context = [], -1
            keep = _common_prefix(st.fed, tokens)
            keep = min(keep, len(tokens) - 1)  # the last token is fed again for its logits
            st.fed = st.fed[:keep]
            need = math.ceil((len(tokens) + k - 1) / self.block_size)
            if need > self.max_blocks or not self._grow(st, need):
                continue
            work.append((seq, st, tokens))
        if not work:
            return
        last = self._catch_up(work)
        for (_seq, st, _tokens), d in zip(work, last, strict=True):
            st.drafts = [d]
        for _ in range(k - 1):
            sched = [ScheduledSeq(seq.seq_id, "draft", [st.drafts[-1]], len(st.fed),
                                  list(st.blocks), True) for seq, st, _ in work]
            for _, st, _t in work:
                st.fed.append(st.drafts[-1])
            nxt = self._argmax(sched)
            for (_, st, _t), d in zip(work, nxt, strict=True):
                st.drafts.append(d)
        for _seq, st, tokens in work:
            st.context = len(tokens)

    def _catch_up(self, work) -> list[int]:
        """Feed every sequence the tokens its draft cache lacks (chunked within the token
        budget); returns each one's argmax after its last token."""
        out: dict[int, int] = {}
        todo = list(range(len(work)))
        while todo:
            batch, used, rest = [], 0, []
            for i in todo:
                _, st, tokens = work[i]
                if used >= self.budget or len(batch) >= self.runner.shape_plan.seq_cap:
                    rest.append(i)
                    continue
                n = min(len(tokens) - len(st.fed), self.budget - used)
                batch.append((i, n))
                used += n
            sched = []
            for i, n in batch:
                seq, st, tokens = work[i]
                start = len(st.fed)
                sched.append(ScheduledSeq(seq.seq_id, "draft", tokens[start : start + n], start,
                                          list(st.blocks), True))
                st.fed.extend(tokens[start : start + n])
            ids = self._argmax(sched)
            for (i, _n), d in zip(batch, ids, strict=True):
                _, st, tokens = work[i]
                if len(st.fed) == len(tokens):
                    out[i] = d
                else:
                    rest.append(i)
            todo = rest
        return [out[i] for i in range(len(work))]

    def _argmax(self, sched: list[ScheduledSeq]) -> list[int]:
        r = self.runner
        inputs = build_step_inputs(sched, self.block_size, r.max_blocks_per_seq,
                                   plan=r.shape_plan, num_groups=r.num_kv_groups)
        logits = np.asarray(r.execute(inputs))
        return [int(x) for x in logits[: len(sched)].argmax(axis=-1)]

    def _grow(self, st: _DraftSeq, need: int) -> bool:
        while len(st.blocks) < need:
            if not self.pool.get_num_free():
                return False
            st.blocks.append(self.pool.allocate())
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
