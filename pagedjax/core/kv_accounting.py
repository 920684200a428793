"""Where the KV cache's slots go (paper Fig. 2): token states vs reserved vs fragmentation.

Slot categories for one snapshot (all in token slots):

- ``token_states``: KV actually written (``num_computed_tokens`` of live sequences);
- ``reserved``: allocated slots that the sequence *will* fill before it finishes;
- ``internal``: allocated (or requested) slots beyond the sequence's final length — never used;
- ``external``: slots lost to the allocator: buddy rounding of a contiguous request up to a
  power of two, plus free slots while requests wait (memory that exists but admits nobody);
- ``free``: unallocated slots while nothing waits (idle capacity, not waste).

The final length of a sequence is prompt + ``SequenceGroup.max_tokens`` (benchmarks force
outputs to that length), capped at ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedjax.baselines.contiguous import ContiguousKVManager
from pagedjax.core.block_manager import BlockManager
from pagedjax.core.sequence import SequenceGroup

CATEGORIES = ("token_states", "reserved", "internal", "external", "free")


def snapshot(bm: BlockManager | ContiguousKVManager, groups: Iterable[SequenceGroup],
             num_waiting: int, max_model_len: int) -> dict[str, int]:
    """Slots per category over the whole GPU pool (sums to ``num_gpu_blocks * block_size``)."""
    bs = bm.block_size
    out = dict.fromkeys(CATEGORIES, 0)
    allocated = 0
    for g in groups:
        for seq in g.get_unfinished_seqs():
            if not bm.has_blocks(seq) or bm.is_swapped(seq):
                continue
            final = min(max_model_len, seq.num_prompt_tokens + (g.max_tokens or max_model_len))
            tokens = seq.num_computed_tokens
            if isinstance(bm, ContiguousKVManager):
                r = bm.region(seq)
                slots = r.num_blocks * bs
                requested = r.requested_tokens
                out["external"] += slots - requested
            else:
                slots = requested = bm.num_held_blocks(seq) * bs
            allocated += slots
            out["token_states"] += tokens
            out["reserved"] += max(0, min(requested, final) - tokens)
            out["internal"] += max(0, requested - max(final, tokens))
    if isinstance(bm, ContiguousKVManager):
        spare = sum(r.num_blocks for r in bm.spare_regions()) * bs
        out["reserved"] += spare
        allocated += spare
    free = bm.num_gpu_blocks * bs - allocated
    out["external" if num_waiting else "free"] += max(0, free)
    return out


def fractions(totals: dict[str, float], include_free: bool = False) -> dict[str, float]:
    """Normalise summed snapshots; by default over the non-idle memory, as Fig. 2 does."""
    keys = [k for k in CATEGORIES if include_free or k != "free"]
    denom = sum(totals[k] for k in keys) or 1
    return {k: totals[k] / denom for k in keys}
