"""The KV manager of a hybrid model: one `BlockManager` per KV-cache group, one block pool.

Each group (see :mod:`pagedjax.core.kv_groups`) keeps its own block table per sequence; a
windowed group allocates lazily and releases blocks behind its window, the global group keeps
every block. They share the GPU and CPU pools, so a block released by a local group is
immediately usable by any group of any request. The scheduler sees the same interface as for
one `BlockManager`; block tables come back as one table per group.

Prefix caching: each group publishes its own blocks under keys tagged with its index, and a
request's hit is the prefix every group has cached (a windowed group's chain starts at block
0, so its early blocks, released and evicted first, bound the hit; shorter, never wrong).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedjax.core.block_manager import (
    AllocStatus,
    BlockManager,
    PrefixHandle,
    admission_status,
    allocate_group,
    cached_tokens,
    check_managers,
    swap_in_status,
    swap_out_fits,
)
from pagedjax.core.block_pool import BlockPool
from pagedjax.core.sequence import Sequence, SequenceGroup


@dataclass
class HybridPrefixHandle:
    """A registered prefix: one pin per group, complete when every group's is."""

    handles: list[PrefixHandle]

    @property
    def complete(self) -> bool:
        return all(h.complete for h in self.handles)

    @property
    def valid(self) -> bool:
        return all(h.valid for h in self.handles)


class HybridBlockManager:
    def __init__(self, group_windows: Seq[int], num_gpu_blocks: int, num_cpu_blocks: int,
                 block_size: int, watermark: float = 0.01, enable_prefix_caching: bool = False,
                 max_chunk_tokens: int | None = None) -> None:
        if len(group_windows) < 2:
            raise ValueError("a hybrid KV manager needs at least two groups")
        if num_gpu_blocks < 1:
            raise ValueError("need at least one GPU block")
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks, enable_caching=False)
        self.groups = [
            BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, watermark=watermark,
                         enable_prefix_caching=enable_prefix_caching, sliding_window=w,
                         max_chunk_tokens=max_chunk_tokens, gpu_pool=self.gpu,
                         cpu_pool=self.cpu, cache_tag=i)
            for i, w in enumerate(group_windows)]
        self.group_windows = tuple(group_windows)
        g0 = self.groups[0]
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = g0.watermark_blocks
        # Nothing is released for every layer at once; the groups release their own blocks.
        self.sliding_window = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # -- queries ----------------------------------------------------------
    def has_blocks(self, seq: Sequence) -> bool:
        return self.groups[0].has_blocks(seq)

    def is_swapped(self, seq: Sequence) -> bool:
        return self.groups[0].is_swapped(seq)

    def get_block_table(self, seq: Sequence) -> tuple[list[int], ...]:
        return tuple(m.get_block_table(seq) for m in self.groups)

    def get_block_table_ref(self, seq: Sequence) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """Each group's live table and version (see `BlockManager.get_block_table_ref`)."""
        refs = [m.get_block_table_ref(seq) for m in self.groups]
        return tuple(t for t, _ in refs), tuple(v for _, v in refs)

    def num_held_blocks(self, seq: Sequence) -> int:
        return sum(m.num_held_blocks(seq) for m in self.groups)

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.get_num_free()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.get_num_free()

    def usage(self) -> float:
        return self.gpu.get_num_used() / self.num_gpu_blocks

    def get_num_cached_tokens(self, seq: Sequence, extra: tuple = (None, None)) -> int:
        return cached_tokens(self.groups, seq, extra)

    # -- admission and growth ------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        return admission_status(self.groups, group)

    def allocate(self, group: SequenceGroup) -> None:
        allocate_group(self.groups, group)

    @property
    def growth_capacity(self) -> int:
        return self.num_gpu_blocks - self.watermark_blocks - sum(len(m._pinned) for m in self.groups)

    def worst_case_blocks(self, prompt_len: int, final_len: int, num_seqs: int) -> int:
        return sum(m.worst_case_blocks(prompt_len, final_len, num_seqs) for m in self.groups)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return sum(m.blocks_needed(seq, num_new_tokens) for m in self.groups)

    def can_append_slots(self, group: SequenceGroup, num_tokens: int | None = None) -> bool:
        need = 0
        for seq in group.seqs:
            if seq.status.is_finished:
                continue
            n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
            need += self.blocks_needed(seq, n)
        return need <= self.gpu.get_num_free()

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        # Windowed groups release first inside their own append, so later groups can reuse.
        copies: list[tuple[int, int]] = []
        for m in sorted(self.groups, key=lambda m: not m.sliding_window):
            copies.extend(m.append_slots(seq, num_new_tokens))
        return copies

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        for m in self.groups:
            m.trim(seq, num_tokens)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        for m in self.groups:
            m.fork(parent_seq, child_seq)

    def free(self, seq: Sequence) -> None:
        for m in self.groups:
            m.free(seq)

    # -- swapping -------------------------------------------------------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return swap_out_fits(self.groups, group)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        if not self.can_swap_out(group):
            raise RuntimeError("not enough CPU blocks to swap out")
        return [pair for m in self.groups for pair in m.swap_out(group)]

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return self.swap_in_status(group) is AllocStatus.OK

    def swap_in_status(self, group: SequenceGroup) -> AllocStatus:
        return swap_in_status(self.groups, group)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        return [pair for m in self.groups for pair in m.swap_in(group)]

    # -- prefix cache -----------------------------------------------------------
    def mark_blocks_computed(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        for m in self.groups:
            m.mark_blocks_computed(seq, num_computed_tokens)

    def register_prefix(self, token_ids: Iterable[int], *, cache_salt: str | None = None,
                        model_id: str | None = None) -> HybridPrefixHandle:
        tokens = tuple(token_ids)
        return HybridPrefixHandle([m.register_prefix(tokens, cache_salt=cache_salt,
                                                     model_id=model_id) for m in self.groups])

    def unpin(self, handle: HybridPrefixHandle) -> None:
        for m, h in zip(self.groups, handle.handles, strict=True):
            m.unpin(h)

    def reset_prefix_cache(self) -> None:
        for m in self.groups:
            m.reset_prefix_cache()

    # -- checking -------------------------------------------------------------
    def check_invariants(self) -> None:
        check_managers(self.groups)
