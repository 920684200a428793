"""Replay clock: the real scheduler and KV manager, with step latencies from a fitted cost model.

Everything but the model is real: ``make_kv_manager``/``make_scheduler`` decide who runs and
where the KV goes, forks and frees go through the same calls the engine makes (so copy-on-write
copies, swaps and preemptions are the real ones); generated tokens are placeholders (outputs
are forced to the trace's length, so tokens never influence scheduling). Step time =
``CostModel`` fitted to steps of the real engine measured in the same run, plus measured
per-block costs of the step's block copies and swaps (labelled "replay" in every JSON/plot).

Sampling modes: ``("single", 1)``; ``("parallel", n)``: the prompt is computed once and forks
into n samples at its first token, as the engine does; ``("beam", w)``: w beams per request,
each step's w survivors pick their parent beam uniformly at random (seeded) from the live
beams -- an assumption standing in for real logits -- the dropped beams are freed and the
survivors forked, in the engine's order (``BeamSearcher.advance`` in ``pagedjax/beam_steps.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from bench.paper.metrics import RunStats, memory_snapshot, step_features
from bench.paper.trace import TraceReq, prompt_ids
from pagedjax.core import SchedulerConfig, Sequence, SequenceGroup
from pagedjax.core.policies import make_kv_manager, make_scheduler
from pagedjax.core.scheduler import SchedulerOutput
from pagedjax.core.sequence import SequenceStatus


@dataclass
class CostModel:
    """seconds = coef . step_features(step) (see :func:`bench.paper.metrics.step_features`)."""

    coef: tuple[float, ...]
    # Block copies and swaps: {"copy"|"swap_out"|"swap_in": (seconds per call, seconds per block)},
    # measured separately (bench/paper/transfer.py), not fitted: calibration steps have none.
    transfers: dict[str, tuple[float, float]] = field(default_factory=dict)

    def with_transfers(self, measured: dict) -> CostModel:
        """A copy using ``measure_transfer_costs``' fixed and per-block costs."""
        keys = ("copy", "swap_out", "swap_in")
        return CostModel(self.coef, {k: (measured[f"{k}_s_fixed"], measured[f"{k}_s_per_block"])
                                     for k in keys})

    def step_time(self, out: SchedulerOutput) -> float:
        """Fitted model step + the step's block copies and swaps at their measured cost."""
        t = self(step_features(out))
        for k, pairs in (("copy", out.blocks_to_copy), ("swap_out", out.blocks_to_swap_out),
                         ("swap_in", out.blocks_to_swap_in)):
            if pairs and k in self.transfers:
                fixed, per_block = self.transfers[k]
                t += fixed + per_block * len(pairs)
        return t

    def __call__(self, feats: tuple[float, ...]) -> float:
        return max(1e-4, float(np.dot(self.coef, feats)))

    @classmethod
    def fit(cls, steps: list[tuple[tuple[float, ...], float]]) -> CostModel:
        """Non-negative least squares (projected) on relative error, so the many cheap
        small-batch steps weigh as much as the few expensive prefill-heavy ones."""
        y = np.array([t for _, t in steps])
        x = np.array([f for f, _ in steps]) / y[:, None]
        y = np.ones_like(y)
        active = list(range(x.shape[1]))
        while True:
            c, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (c >= 0).all() or len(active) == 1:
                break
            active = [a for a, v in zip(active, c) if v >= 0] or active[:1]
        coef = np.zeros(x.shape[1])
        coef[active] = np.maximum(c, 0)
        return cls(tuple(float(v) for v in coef))

    def rel_error(self, steps) -> float:
        """Relative error of total predicted vs measured time over ``steps``."""
        pred = sum(self(f) for f, _ in steps)
        real = sum(t for _, t in steps)
        return (pred - real) / real

    def step_mape(self, steps) -> float:
        """Mean absolute percentage error of single-step predictions."""
        return float(np.mean([abs(self(f) - t) / t for f, t in steps]))


VOCAB = 49152  # SmolLM2's; only matters for prefix-cache hashing of distinct prompts


def replay(policy: str, trace: list[TraceReq], cost: CostModel, *, num_blocks: int, block_size: int,
           max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
           sampling: tuple[str, int] = ("single", 1), prefix_caching: bool = False,
           preemption_mode: str = "recompute", num_cpu_blocks: int = 0, seed: int = 0) -> dict:
    mode, k = sampling
    if mode not in ("single", "parallel", "beam"):
        raise ValueError(f"unknown sampling mode {mode!r}")
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, preemption_mode=preemption_mode)
    bm = make_kv_manager(policy, num_blocks, num_cpu_blocks, block_size, max_model_len=max_model_len,
                         enable_prefix_caching=prefix_caching)
    sched = make_scheduler(policy, cfg, bm)
    rng = np.random.default_rng(seed)
    seq_ids = itertools.count(len(trace))
    tokens = itertools.count(VOCAB)  # generated ids never collide with prompt ids
    stats = RunStats()
    counts = {"blocks_copied": 0, "blocks_swapped_out": 0, "blocks_swapped_in": 0, "preemptions": 0}
    pending = sorted(trace, key=lambda r: r.arrival)
    arrival: dict[str, TraceReq] = {}
    t, i = 0.0, 0
    while i < len(pending) or sched.has_unfinished_seqs():
        while i < len(pending) and pending[i].arrival <= t:
            r = pending[i]
            ids = prompt_ids(r, VOCAB) if prefix_caching else [1] * r.prompt_len
            g = SequenceGroup(str(r.index), [Sequence(r.index, ids)], r.arrival, max_tokens=r.output_len,
                              n=k if mode != "single" else 1)
            sched.add_seq_group(g)
            arrival[g.request_id] = r
            i += 1
        out = sched.schedule()
        if out.is_empty:
            if i >= len(pending):
                raise RuntimeError(f"{policy}: scheduler stalled with work left")
            t = max(t, pending[i].arrival)
            continue
        snap = memory_snapshot(sched, max_model_len)
        dt = cost.step_time(out)
        t += dt
        counts["blocks_copied"] += len(out.blocks_to_copy)
        counts["blocks_swapped_out"] += len(out.blocks_to_swap_out)
        counts["blocks_swapped_in"] += len(out.blocks_to_swap_in)
        counts["preemptions"] += len(out.preempted)
        sched.update_after_step(out)
        sampled = {s.seq_id for s in out.scheduled if s.needs_logits}
        for g in out.scheduled_groups:
            live = [s for s in g.get_unfinished_seqs() if s.seq_id in sampled]
            if not live:
                continue  # a prompt chunk: no token yet
            if mode == "beam":
                live = _beam_step(sched, g, live, k, rng, seq_ids)
            elif mode == "parallel" and len(g.seqs) == 1 and not live[0].output_token_ids:
                for _ in range(k - 1):  # fan out at the first token; children share the prompt
                    child = live[0].fork(next(seq_ids))
                    sched.fork_seq(live[0], child)
                    g.add(child)
                live = g.get_unfinished_seqs()
            for seq in live:
                seq.append_token(next(tokens))
            r = arrival[g.request_id]
            if live[0].num_output_tokens >= r.output_len:
                for seq in g.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_LENGTH
                stats.latencies.append((t - r.arrival, r.output_len))
        sched.free_finished_seq_groups()
        stats.record_step(out, dt, snap)
    if bm.get_num_free_gpu_blocks() != num_blocks:  # cached prefix blocks count as free
        held = num_blocks - bm.get_num_free_gpu_blocks()
        raise RuntimeError(f"{policy}: replay ended with {held} blocks held")
    return {**stats.summary(), **counts}


def _beam_step(sched, g: SequenceGroup, live: list[Sequence], width: int, rng: np.random.Generator,
               seq_ids) -> list[Sequence]:
    """``width`` survivors pick random parents; free dropped beams first, then fork (engine order)."""
    if len(live) != len(g.get_unfinished_seqs()):
        raise RuntimeError(f"request {g.request_id}: beams scheduled apart")
    parents = rng.integers(0, len(live), size=width)
    keep = set(parents.tolist())
    for j, s in enumerate(live):
        if j not in keep:
            sched.free_seq(s)
            s.status = SequenceStatus.FINISHED_ABORTED
            g.remove(s.seq_id)
    new, used = [], set()
    for p in parents.tolist():
        parent = live[p]
        if p in used:
            child = parent.fork(next(seq_ids))
            sched.fork_seq(parent, child)
            g.add(child)
            new.append(child)
        else:
            used.add(p)
            new.append(parent)
    return new
