"""Host-side core: sequences, KV block accounting and the iteration-level scheduler.

Pure Python on purpose: it runs on the host every step, must not touch an
accelerator, and stays importable without JAX or numpy.
"""

from pagedjax.core.block_manager import AllocStatus, BlockManager, PrefixHandle
from pagedjax.core.block_pool import BlockPool
from pagedjax.core.scheduler import (
    AppliedToken,
    SampledToken,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from pagedjax.core.sequence import Sequence, SequenceGroup, SequenceStatus, TokenStops

__all__ = [
    "AllocStatus",
    "AppliedToken",
    "SampledToken",
    "BlockManager",
    "BlockPool",
    "PrefixHandle",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "TokenStops",
]
