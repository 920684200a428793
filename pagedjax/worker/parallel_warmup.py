"""Run warm-up's independent compilations side by side.

XLA compiles with the GIL released, so threads overlap compilations: on a GPU one step shape
of an 8B model compiles (and autotunes) for seconds, and the one-at-a-time warm-up of a
13B-like engine (31 step shapes, ~500 sampler and beam-selection variants) had not finished
after the 276 s the paper benchmark had on an H200. Each warm-up call also allocates its
dummy inputs and temporaries on the device, whose memory the KV cache has mostly taken, so
calls are admitted by a byte budget, not only by thread count.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterable

ENV_THREADS = "PAGEDJAX_WARMUP_THREADS"
MAX_DEFAULT_THREADS = 8


def warmup_threads() -> int:
    """Threads for warm-up: ``$PAGEDJAX_WARMUP_THREADS``, else the CPU count capped at 8
    (1 gives the sequential warm-up)."""
    raw = os.environ.get(ENV_THREADS)
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_THREADS} must be a positive integer, got {raw!r}") from None
        if n < 1:
            raise ValueError(f"{ENV_THREADS} must be a positive integer, got {raw!r}")
        return n
    return max(1, min(MAX_DEFAULT_THREADS, os.cpu_count() or 1))


def run_bounded(pool: cf.Executor, calls: Iterable[tuple[int, Callable[[], object]]],
                max_bytes: int) -> int:
    """Run ``(bytes, thunk)`` calls on ``pool`` with at most ``max_bytes`` of them in flight
    (a call larger than the budget runs alone). Calls are drawn lazily, in order; the first
    error is raised after the calls in flight finish. Returns the number of calls run."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    inflight: dict[cf.Future, int] = {}
    used = done = 0
    error: BaseException | None = None

    def reap(wait_for: str) -> None:
        nonlocal used, done, error
        finished, _ = cf.wait(list(inflight), return_when=wait_for)
        for f in finished:
            used -= inflight.pop(f)
            done += 1
            if error is None and f.exception() is not None:
                error = f.exception()

    for size, thunk in calls:
        if size < 0:
            raise ValueError(f"a warm-up call's bytes must be >= 0, got {size}")
        while inflight and (used + size > max_bytes or error is not None):
            reap(cf.FIRST_COMPLETED)
        if error is not None:
            break
        inflight[pool.submit(thunk)] = size
        used += size
    while inflight:
        reap(cf.ALL_COMPLETED)
    if error is not None:
        raise error
    return done


DEFAULT_HOST_BUDGET = 4 << 30  # no device memory statistics (XLA:CPU): host RAM


def warmup_memory_budget() -> int:
    """Bytes warm-up calls may hold at once: half of what the first local device has free
    after the KV cache (its memory statistics), else 4 GiB of host memory."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use")
    if limit is None or used is None:
        return DEFAULT_HOST_BUDGET
    return max(0, (limit - used) // 2)
