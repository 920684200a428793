"""KV-cache / scheduling policy factory: the paged engine or one of the paper's baselines.

``paged`` is the real system (:class:`BlockManager`). The others exist to be
measured against it (paper §6): Orca-style contiguous reservations
(``contiguous-max|pow2|oracle``) with iteration-level scheduling, and
FasterTransformer-style ``static`` batching (request-level batches over
max-length contiguous reservations).
"""

from __future__ import annotations

from pagedjax.baselines.contiguous import ContiguousKVManager
from pagedjax.baselines.static_batching import StaticBatchScheduler
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.scheduler import Scheduler, SchedulerConfig

KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "static")


def make_kv_manager(policy: str, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, *,
                    enable_prefix_caching: bool = False, max_model_len: int,
                    watermark: float = 0.01, sliding_window: int = 0
                    ) -> BlockManager | ContiguousKVManager:
    """The block manager for ``policy`` (one of :data:`KV_POLICIES`). ``sliding_window``:
    the model's widest window when every layer is windowed (blocks behind it are released);
    the contiguous baselines keep whole regions and ignore it."""
    if policy == "paged":
        return BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, watermark=watermark,
                            enable_prefix_caching=enable_prefix_caching,
                            sliding_window=sliding_window)
    if policy not in KV_POLICIES:
        raise ValueError(f"unknown kv policy {policy!r}; expected one of {KV_POLICIES}")
    if enable_prefix_caching:
        raise ValueError(f"kv policy {policy!r} does not support prefix caching")
    contiguous = "max" if policy == "static" else policy.removeprefix("contiguous-")
    return ContiguousKVManager(num_gpu_blocks, num_cpu_blocks, block_size, policy=contiguous,
                               max_model_len=max_model_len)


def make_scheduler(policy: str, config: SchedulerConfig, bm) -> Scheduler:
    """Iteration-level scheduler for every policy except ``static`` (request-level batches)."""
    if policy not in KV_POLICIES:
        raise ValueError(f"unknown kv policy {policy!r}; expected one of {KV_POLICIES}")
    return StaticBatchScheduler(config, bm) if policy == "static" else Scheduler(config, bm)
