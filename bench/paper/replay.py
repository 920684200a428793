"""Replay clock: the real scheduler and KV manager, with step latencies from a fitted cost model.

Everything but the model is real: ``make_kv_manager``/``make_scheduler`` decide who runs and
where the KV goes; generated tokens are placeholders (outputs are forced to the trace's
length, so tokens never influence scheduling). Step time = ``CostModel`` fitted to steps of
the real engine measured in the same run (labelled "replay" in every JSON/plot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.paper.metrics import RunStats, memory_snapshot, step_features
from bench.paper.trace import TraceReq
from pagedjax.core import SchedulerConfig, Sequence, SequenceGroup
from pagedjax.core.policies import make_kv_manager, make_scheduler
from pagedjax.core.sequence import SequenceStatus


@dataclass
class CostModel:
    """seconds = coef . step_features(step) (see :func:`bench.paper.metrics.step_features`)."""

    coef: tuple[float, ...]

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


def replay(policy: str, trace: list[TraceReq], cost: CostModel, *, num_blocks: int, block_size: int,
           max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    bm = make_kv_manager(policy, num_blocks, 0, block_size, max_model_len=max_model_len)
    sched = make_scheduler(policy, cfg, bm)
    stats = RunStats()
    pending = sorted(trace, key=lambda r: r.arrival)
    arrival: dict[str, TraceReq] = {}
    t, i = 0.0, 0
    while i < len(pending) or sched.has_unfinished_seqs():
        while i < len(pending) and pending[i].arrival <= t:
            r = pending[i]
            g = SequenceGroup(str(r.index), [Sequence(r.index, [1] * r.prompt_len)], r.arrival,
                              max_tokens=r.output_len)
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
        dt = cost(step_features(out))
        t += dt
        sched.update_after_step(out)
        for s in out.scheduled:
            if not s.needs_logits:
                continue
            g = next(g for g in out.scheduled_groups if g.request_id == s.request_id)
            seq = g.seqs[0]
            seq.append_token(7)
            if seq.num_output_tokens >= g.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH
                r = arrival[g.request_id]
                stats.latencies.append((t - r.arrival, r.output_len))
        sched.free_finished_seq_groups()
        stats.record_step(out, dt, snap)
    return stats.summary()
