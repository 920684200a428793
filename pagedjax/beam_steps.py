"""The engine's side of beam search (math in `beam_search.py`).

Each step, `candidates` launches on-device candidate selection for every beam request whose
live beams all have a logits row in the step (one jitted call over the sampler's raw
log-softmax); a request whose beams the token budget split over steps is finished in numpy
once the missing rows arrive. `advance` applies one request's chosen candidates on the host:
finished hypotheses are recorded, dropped beams freed, survivors forked (sharing every block,
copy-on-write on the next write) and extended.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from pagedjax.beam_search import (
    beam_candidates_from_rows,
    beam_candidates_numpy,
    length_penalized_score,
    should_stop,
    split_candidates,
)
from pagedjax.core import Sequence
from pagedjax.core.sequence import SequenceStatus
from pagedjax.output_processor import OutputProcessor, RequestState
from pagedjax.worker.shapes import pow2_at_least


def selection_shape(groups: list[tuple[int, int]]) -> tuple[int, int]:
    """(padded groups, padded width) of one step's device selection; ``groups`` holds each
    ready group's (live beams, beam width). Candidates come from 2 * width columns: at least
    twice the widest beam width (on its first step a group has one live beam but needs
    2 * beam_width candidates)."""
    return (pow2_at_least(len(groups)),
            pow2_at_least(max(max(live, width) for live, width in groups)))


def warm_selection_shapes(batch_sizes: list[int], max_width: int,
                          max_num_seqs: int) -> list[tuple[int, int, int]]:
    """Every (sampler batch, padded groups, padded width) of :func:`selection_shape` with beam
    widths up to ``max_width``: what warm-up compiles.

    Each ready group has at least one row in the batch, and reserves its beam width (>= 2) of
    the step's ``max_num_seqs`` sequences, so groups <= min(batch, max_num_seqs // 2). A
    group's width is its beam width, not its live rows, so the width may exceed the batch (a
    width-4 group whose beams but one ended, alone in a decode step: batch 1), and groups x
    width may reach 8 x batch (16 width-8 prompts each prefilling one last token in a 16-row
    step, with max_num_seqs 128).
    """
    out = []
    for b in batch_sizes:
        w = 2
        while w <= pow2_at_least(max_width):
            g = 1
            while g <= pow2_at_least(min(b, max(1, max_num_seqs // 2))):
                out.append((b, g, w))
                g *= 2
            w *= 2
    return out


class BeamSearcher:
    def __init__(self, scheduler, outputs: OutputProcessor, new_seq_id: Callable[[], int]):
        self.scheduler = scheduler
        self.outputs = outputs
        self.new_seq_id = new_seq_id
        self.dropped: list[int] = []  # beams dropped since `take_dropped`

    def take_dropped(self) -> list[int]:
        """Ids of the beams dropped since the last call: the engine releases their per-sequence
        state (batch rows, sampling slots, history slots) as it does finished sequences'."""
        out, self.dropped = self.dropped, []
        return out

    def candidates(self, logprobs: jax.Array, row_info: list[tuple], requests: dict[str, RequestState]):
        """Launch on-device candidate selection for every beam group whose live beams all have
        logprobs rows in this step (rows of the sampler's raw log-softmax ``[B, V]``).

        Returns ``(groups, device candidates, host candidates, host groups)`` or None; a group
        whose beams were split over steps by the token budget is finished on the host.
        """
        rows: dict[str, dict[int, int]] = {}
        for r, (req, seq, _index, _fan) in enumerate(row_info):
            if req.is_beam:
                rows.setdefault(req.request_id, {})[seq.seq_id] = r
        if not rows:
            return None
        ready: list[tuple[RequestState, list[Sequence], list[int]]] = []
        host_groups: list[tuple[RequestState, list[Sequence]]] = []
        host_cands = []
        for rid, by_seq in rows.items():
            req = requests[rid]
            live = req.group.get_unfinished_seqs()
            if all(s.seq_id in by_seq for s in live):
                ready.append((req, live, [by_seq[s.seq_id] for s in live]))
                continue
            # Split group (rare): keep these rows on the host until the siblings arrive.
            got = np.asarray(jax.device_get(logprobs[np.asarray(list(by_seq.values()))]))
            for sid, row in zip(by_seq, got):
                req.beam_pending[sid] = row
            if all(s.seq_id in req.beam_pending for s in live):
                lp = np.stack([req.beam_pending.pop(s.seq_id) for s in live])
                host_cands.append(beam_candidates_numpy(
                    lp, [s.cumulative_logprob for s in live], 2 * req.params.beam_width))
                host_groups.append((req, live))
        if not ready and not host_groups:
            return None
        groups = [(req, live) for req, live, _ in ready]
        if not ready:
            return groups, None, [jax.tree.map(lambda x: x[0], c) for c in host_cands], host_groups
        g_pad, width = selection_shape([(len(cols), req.params.beam_width) for req, _, cols in ready])
        idx = np.zeros((g_pad, width), np.int32)
        live_mask = np.zeros((g_pad, width), bool)
        cum = np.zeros((g_pad, width), np.float32)
        for g, (_req, live, cols) in enumerate(ready):
            idx[g, : len(cols)] = cols
            live_mask[g, : len(cols)] = True
            cum[g, : len(cols)] = [s.cumulative_logprob for s in live]
        cands = beam_candidates_from_rows(logprobs, idx, cum, live_mask, 2 * width)
        return groups, cands, [jax.tree.map(lambda x: x[0], c) for c in host_cands], host_groups

    def advance(self, req: RequestState, live: list[Sequence], parents, tokens, cums, valid) -> None:
        """One beam step on the host: finish EOS hypotheses, free dropped beams, fork survivors."""
        p = req.params
        width = p.beam_width
        eos = set() if p.ignore_eos else self.outputs.eos_token_ids | set(p.stop_token_ids)
        new_live, new_fin = split_candidates(parents, tokens, cums, width, eos, valid)
        for c in new_fin:
            parent = live[c.parent]
            done = parent.fork(self.new_seq_id())  # history only: a finished beam holds no blocks
            done.append_token(c.token_id, c.cum_logprob - parent.cumulative_logprob)
            done.cumulative_logprob = c.cum_logprob
            done.status = SequenceStatus.FINISHED_STOPPED
            score = length_penalized_score(c.cum_logprob, parent.num_total_tokens, p.length_penalty)
            req.beam_finished.append((score, done))
        # Free dropped beams BEFORE forking: the contiguous baselines give each fork its own
        # region from the buddy allocator, and on a full pool only a dropped beam's region (same
        # size) can take it. Paged forks share the parent's blocks, and a dropped beam is never a
        # parent, so the order changes nothing there.
        parents = {live[c.parent].seq_id for c in new_live}
        for s in live:
            if s.seq_id not in parents:  # no surviving candidate: drop the beam and its blocks
                self.scheduler.free_seq(s)
                s.status = SequenceStatus.FINISHED_ABORTED
                req.group.remove(s.seq_id)
                req.forget(s)
                self.dropped.append(s.seq_id)
        used: set[int] = set()
        assigned: list[tuple[Sequence, float, int]] = []
        for c in new_live:  # fork before any append: children copy the parent's pre-step state
            parent = live[c.parent]
            if parent.seq_id in used:
                target = parent.fork(self.new_seq_id())
                self.scheduler.fork_seq(parent, target)  # paged: shares every block, CoW on next write
                req.group.add(target)
                req.register(target, len(req.seq_index))
            else:
                used.add(parent.seq_id)
                target = parent
            assigned.append((target, c.cum_logprob, c.token_id))
        for target, cum, token in assigned:
            target.append_token(token, cum - target.cumulative_logprob)
            target.cumulative_logprob = cum
            self.outputs.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        survivors = [t for t, _, _ in assigned]
        if not survivors:
            return
        best = survivors[0]  # candidates are sorted best-first
        at_limit = (best.num_output_tokens >= p.max_tokens
                    or best.num_total_tokens >= self.outputs.max_model_len)
        if at_limit:  # the live beams are hypotheses too
            for s in survivors:
                s.status = SequenceStatus.FINISHED_LENGTH
                score = length_penalized_score(s.cumulative_logprob, s.num_total_tokens, p.length_penalty)
                req.beam_finished.append((score, s))
        elif should_stop([sc for sc, _ in req.beam_finished], best.cumulative_logprob,
                         best.num_total_tokens, width, p.length_penalty, p.early_stopping,
                         min(best.num_prompt_tokens + p.max_tokens, self.outputs.max_model_len)):
            for s in survivors:
                s.status = SequenceStatus.FINISHED_ABORTED  # not returned: cannot beat the finished
