"""Contiguous (Orca-style) KV cache manager: one pre-reserved region per sequence.

The baselines of paper §6.1. At admission each sequence reserves a contiguous
run of blocks from a :class:`BuddyAllocator` over the same block pool the paged
engine uses, sized by a policy:

- ``max``:    ``max_model_len`` tokens (Orca (Max));
- ``pow2``:   prompt + next_pow2(true output length) (Orca (Pow2), at most 2x over-reservation);
- ``oracle``: prompt + true output length exactly (Orca (Oracle)).

The true output length is ``SequenceGroup.max_tokens`` (benchmarks force it with
``ignore_eos=True``). The region never grows, so a running sequence never needs
new memory and is never preempted. The block table handed to the scheduler is a
contiguous block range of the region, so attention reads it through the same
paged kernels: what differs from ``BlockManager`` is memory management only.

Drop-in for :class:`~pagedjax.core.block_manager.BlockManager` as far as the
scheduler and engine use it; no prefix caching and no swapping (sequences are
never preempted, and ``can_swap_out`` says no so a forced preemption recomputes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.baselines.buddy_allocator import BuddyAllocator, next_pow2
from pagedjax.core.block_manager import AllocStatus
from pagedjax.core.sequence import Sequence, SequenceGroup

POLICIES = ("max", "pow2", "oracle")
_NEVER_FITS = 1 << 62  # blocks_needed() for growth beyond the region: never satisfiable


@dataclass
class Region:
    """One sequence's reservation: ``num_blocks`` (a power of two) blocks from ``start``."""

    start: int
    num_blocks: int
    requested_tokens: int  # what the policy asked for, before buddy rounding
    final_len: int  # prompt + true output length (for memory accounting)
    pending_copies: list[tuple[int, int]] = field(default_factory=list)


class ContiguousKVManager:
    """Per-sequence contiguous regions over a buddy-allocated block pool."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, *,
                 policy: str, max_model_len: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown contiguous policy {policy!r}; expected one of {POLICIES}")
        if block_size < 1 or max_model_len < 1:
            raise ValueError("block_size and max_model_len must be >= 1")
        self.policy = policy
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = False
        self.buddy = BuddyAllocator(num_gpu_blocks)
        self._regions: dict[int, Region] = {}
        self._spares: dict[int, list[Region]] = {}  # parent seq id -> regions for future forks

    # -- reservation rule -------------------------------------------------------
    def final_len(self, seq: Sequence, group: SequenceGroup) -> int:
        out = group.max_tokens if group.max_tokens is not None else self.max_model_len
        return min(self.max_model_len, seq.num_prompt_tokens + out)

    def reservation_tokens(self, seq: Sequence, group: SequenceGroup) -> int:
        """Tokens the policy reserves for ``seq`` at admission (before buddy rounding)."""
        if self.policy == "max":
            return self.max_model_len
        out = self.final_len(seq, group) - seq.num_prompt_tokens
        if self.policy == "pow2":
            out = next_pow2(max(1, out))
        # Recomputation after a forced preemption may already hold more tokens.
        need = max(seq.num_prompt_tokens + out, seq.num_total_tokens)
        return min(self.max_model_len, need)

    def _blocks(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block_size))

    def _requests(self, group: SequenceGroup) -> list[int]:
        """Blocks each region of the group needs, children of a fresh n>1 prompt included."""
        seqs = group.get_unfinished_seqs()
        sizes = [self._blocks(self.reservation_tokens(s, group)) for s in seqs]
        if len(seqs) == 1 and len(group.seqs) == 1 and group.n > 1:
            sizes += sizes * (group.n - 1)
        return sizes

    @property
    def growth_capacity(self) -> int:
        return self.num_gpu_blocks

    def worst_case_blocks(self, prompt_len: int, final_len: int, num_seqs: int) -> int:
        """Regions are reserved whole at admission (buddy-rounded), so growth is already paid:
        this is what admission itself checks, for the interface the engine shares."""
        if self.policy == "max":
            final_len = self.max_model_len
        elif self.policy == "pow2":
            final_len = min(self.max_model_len,
                            prompt_len + next_pow2(max(1, final_len - prompt_len)))
        return num_seqs * next_pow2(self._blocks(final_len))

    # -- admission ----------------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        sizes = self._requests(group)
        if sum(next_pow2(b) for b in sizes) > self.num_gpu_blocks or not all(
            self.buddy.fits_ever(b) for b in sizes
        ):
            return AllocStatus.NEVER
        starts: list[int] = []
        try:  # trial allocation; buddy state is canonical so freeing restores it exactly
            for b in sizes:
                starts.append(self.buddy.allocate(b))
            return AllocStatus.OK
        except MemoryError:
            return AllocStatus.LATER
        finally:
            for s in starts:
                self.buddy.free(s)

    def allocate(self, group: SequenceGroup) -> None:
        seqs = group.get_unfinished_seqs()
        for seq in seqs:
            if seq.seq_id in self._regions:
                raise ValueError(f"sequence {seq.seq_id} already has blocks")
            self._regions[seq.seq_id] = self._new_region(seq, group)
            seq.num_computed_tokens = 0
        if len(seqs) == 1 and len(group.seqs) == 1 and group.n > 1:
            self._spares[seqs[0].seq_id] = [self._new_region(seqs[0], group) for _ in range(group.n - 1)]

    def _new_region(self, seq: Sequence, group: SequenceGroup) -> Region:
        tokens = self.reservation_tokens(seq, group)
        nblocks = self._blocks(tokens)
        start = self.buddy.allocate(nblocks)
        return Region(start, self.buddy.size_of(start), tokens, self.final_len(seq, group))

    # -- growth -------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        r = self._state(seq)
        fits = seq.num_computed_tokens + num_new_tokens <= r.num_blocks * self.block_size
        return 0 if fits else _NEVER_FITS

    def can_append_slots(self, group: SequenceGroup, num_tokens: int | None = None) -> bool:
        for seq in group.get_unfinished_seqs():
            n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
            if self.blocks_needed(seq, n):
                return False
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Slots are pre-reserved; returns the block copies a fresh fork still owes."""
        r = self._state(seq)
        if self.blocks_needed(seq, num_new_tokens):
            raise MemoryError(f"sequence {seq.seq_id} outgrew its contiguous region")
        copies, r.pending_copies = r.pending_copies, []
        return copies

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """No sharing in a contiguous cache: the child gets its own region and a copy of the KV."""
        parent = self._state(parent_seq)
        if child_seq.seq_id in self._regions:
            raise ValueError(f"sequence {child_seq.seq_id} already has blocks")
        spares = self._spares.get(parent_seq.seq_id)
        if spares:
            child = spares.pop()
        else:
            start = self.buddy.allocate(parent.num_blocks)
            child = Region(start, self.buddy.size_of(start), parent.requested_tokens, parent.final_len)
        n = self._blocks(parent_seq.num_computed_tokens) if parent_seq.num_computed_tokens else 0
        child.pending_copies = [(parent.start + i, child.start + i) for i in range(n)]
        self._regions[child_seq.seq_id] = child

    def free(self, seq: Sequence) -> None:
        r = self._regions.pop(seq.seq_id, None)
        if r is not None:
            self.buddy.free(r.start)
        for spare in self._spares.pop(seq.seq_id, []):
            self.buddy.free(spare.start)

    # -- queries ----------------------------------------------------------------------
    def _state(self, seq: Sequence) -> Region:
        try:
            return self._regions[seq.seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq.seq_id} has no blocks") from None

    def region(self, seq: Sequence) -> Region | None:
        return self._regions.get(seq.seq_id)

    def regions(self) -> dict[int, Region]:
        return dict(self._regions)

    def spare_regions(self) -> list[Region]:
        return [r for rs in self._spares.values() for r in rs]

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._regions

    def is_swapped(self, seq: Sequence) -> bool:
        return False

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The leading blocks of the region that hold the sequence's tokens (a contiguous range),
        counting the token sampled by a step still in flight (async scheduling: its KV is
        written by the step being scheduled, one slot past the known tokens) and drafts."""
        r = self._state(seq)
        tokens = seq.num_total_tokens + seq.num_pending + len(seq.spec_token_ids)
        n = min(r.num_blocks, self._blocks(tokens))
        return list(range(r.start, r.start + n))

    def get_block_table_ref(self, seq: Sequence) -> tuple[list[int], int]:
        """A fresh table with no version (-1): the runner's batch rewrites its row each step."""
        return self.get_block_table(seq), -1

    def get_num_free_gpu_blocks(self) -> int:
        return self.buddy.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.num_cpu_blocks

    def usage(self) -> float:
        return self.buddy.num_allocated / self.num_gpu_blocks

    def get_num_cached_tokens(self, seq: Sequence, extra: tuple = (None, None)) -> int:
        return 0

    # -- swapping / prefix cache: unsupported by the baseline ------------------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise RuntimeError("the contiguous baseline does not swap")

    def swap_in_status(self, group: SequenceGroup) -> AllocStatus:
        return AllocStatus.NEVER

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return False

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise RuntimeError("the contiguous baseline does not swap")

    def mark_blocks_computed(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        return None

    def register_prefix(self, token_ids, **kwargs):
        raise ValueError("the contiguous baseline has no prefix cache")

    def unpin(self, handle) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    def check_invariants(self) -> None:
        self.buddy.check_invariants()
        starts = [r.start for r in self._regions.values()] + [r.start for r in self.spare_regions()]
        assert len(set(starts)) == len(starts), "two sequences share a region"
        for r in list(self._regions.values()) + self.spare_regions():
            assert self.buddy.size_of(r.start) == r.num_blocks, "region size disagrees with allocator"
            assert r.num_blocks * self.block_size >= r.requested_tokens, "region too small"
