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
from pagedjax.core.hybrid_kv_manager import HybridBlockManager
from pagedjax.core.kv_groups import KVGroupLayout
from pagedjax.core.scheduler import Scheduler, SchedulerConfig

KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "static")


def make_kv_manager(policy: str, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, *,
                    enable_prefix_caching: bool = False, max_model_len: int,
                    watermark: float = 0.01, sliding_window: int = 0,
                    layout: KVGroupLayout | None = None, max_chunk_tokens: int | None = None
                    ) -> BlockManager | HybridBlockManager | ContiguousKVManager:
    """The block manager for ``policy`` (one of :data:`KV_POLICIES`). ``layout``: the model's
    KV-cache groups (a hybrid layout gets a `HybridBlockManager`; one group released behind
    its window when every layer is windowed); ``sliding_window`` instead of a layout: that
    window for every layer. ``max_chunk_tokens``: the scheduler's token budget (bounds a
    windowed sequence's blocks). The contiguous baselines keep whole regions and ignore both."""
    if policy == "paged":
        if layout is not None and layout.hybrid:
            return HybridBlockManager(layout.group_windows, num_gpu_blocks, num_cpu_blocks,
                                      block_size, watermark=watermark,
                                      enable_prefix_caching=enable_prefix_caching,
                                      max_chunk_tokens=max_chunk_tokens)
        if layout is not None:
            sliding_window = layout.group_windows[0]
        return BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, watermark=watermark,
                            enable_prefix_caching=enable_prefix_caching,
                            sliding_window=sliding_window, max_chunk_tokens=max_chunk_tokens)
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
