"""Per-run bookkeeping shared by real execution and the replay clock."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.core.kv_accounting import CATEGORIES, fractions, snapshot
from pagedjax.core.scheduler import SchedulerOutput
from pagedjax.worker.step_inputs import bucket

FEATURES = ("decode_step", "prefill_step", "rows_padded", "prefill_tokens_padded", "kv_tokens")


def step_features(out: SchedulerOutput) -> tuple[float, ...]:
    """Cost-model features of one step: decode-only?, has prefill?, padded rows, padded
    prefill tokens, KV tokens read.

    Padding follows ``build_step_inputs`` (sequence buckets of 8, token buckets of 16);
    decode-only and mixed steps compile to different programs, hence two intercepts.
    """
    s = len(out.scheduled)
    prefill = sum(len(x.token_ids) for x in out.scheduled if len(x.token_ids) > 1)
    decode_only = prefill == 0
    kv = sum(x.start_pos + len(x.token_ids) for x in out.scheduled)
    rows = bucket(s, 8) if s else 0
    tokens = 0 if decode_only else bucket(out.num_batched_tokens, 16)
    return (float(decode_only), float(not decode_only), float(rows), float(tokens), float(kv))


def memory_snapshot(sched, max_model_len: int) -> dict[str, int]:
    """KV slot breakdown while a step runs (after admission, before finished requests free).

    Free memory while requests wait counts as waste only if the sequence cap is not what
    keeps them waiting.
    """
    num_waiting = len(sched.waiting)
    if sum(g.num_unfinished for g in sched.running) >= sched.config.max_num_seqs:
        num_waiting = 0
    return snapshot(sched.bm, sched.running, num_waiting, max_model_len)


@dataclass
class RunStats:
    """Accumulates step-weighted batch sizes, memory breakdown and request latencies."""

    time: float = 0.0
    batch_time: float = 0.0  # sum of batch size x step duration
    mem: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    latencies: list[tuple[float, int]] = field(default_factory=list)  # (e2e seconds, output len)
    steps: list[tuple[tuple[float, ...], float]] = field(default_factory=list)  # (features, secs)

    def record_step(self, out: SchedulerOutput, dt: float, snap: dict[str, int]) -> None:
        """``snap``: :func:`memory_snapshot` taken right after ``schedule()`` returned."""
        self.time += dt
        self.batch_time += len(out.scheduled_groups) * dt
        for k, v in snap.items():
            self.mem[k] += v * dt
        self.steps.append((step_features(out), dt))

    def summary(self) -> dict:
        lat = self.latencies
        return {
            "num_finished": len(lat),
            "normalized_latency_s_per_token": sum(e / n for e, n in lat) / max(1, len(lat)),
            "mean_latency_s": sum(e for e, _ in lat) / max(1, len(lat)),
            "avg_batched_requests": self.batch_time / self.time if self.time else 0.0,
            "memory_fractions": fractions(self.mem),
            "busy_time_s": self.time,
        }


def sustainable(rates: list[float], lat: list[float], thr: float) -> float:
    """Rate where normalized latency crosses ``thr`` (linear interpolation; 0 if never below)."""
    best = 0.0
    for k, (r, v) in enumerate(zip(rates, lat)):
        if v <= thr:
            best = r
            continue
        if k and lat[k - 1] <= thr:
            r0, v0 = rates[k - 1], lat[k - 1]
            best = r0 + (thr - v0) * (r - r0) / (v - v0)
        break
    return best
