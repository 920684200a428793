"""Physical KV block pool: ref counts, LRU free list and the prefix-cache map.

A block is either free (ref count 0, in the free list) or referenced, never
both. Free blocks that still hold a registered prefix-cache entry stay
reusable until the allocator evicts them from the head of the free list, so
the free list doubles as the LRU eviction order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

ROOT_SERIAL = 0  # parent "entry" of the first block of every sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra: tuple) -> int:
    """Chained content hash of one full block (tests monkeypatch this to force collisions)."""
    return hash((parent_hash, token_ids, extra))


class BlockKey:
    """Identity of a cached block: parent entry, its token ids and extra keys.

    ``__hash__`` is the chained content hash, but equality compares the stored
    tokens, extra keys and the *serial* of the parent entry, so a hash
    collision is a miss rather than a wrong hit. Comparing the parent serial
    (not the parent hash) keeps the check exact across the whole prefix even
    when the hash function is degenerate: two equal keys imply equal token
    prefixes by induction.
    """

    __slots__ = ("parent_serial", "token_ids", "extra", "hash_value")

    def __init__(
        self,
        parent_serial: int,
        parent_hash: int | None,
        token_ids: tuple[int, ...],
        extra: tuple,
    ) -> None:
        self.parent_serial = parent_serial
        self.token_ids = token_ids
        self.extra = extra
        self.hash_value = hash_block(parent_hash, token_ids, extra)

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockKey)
            and self.parent_serial == other.parent_serial
            and self.token_ids == other.token_ids
            and self.extra == other.extra
        )

    def __repr__(self) -> str:
        return f"BlockKey(parent={self.parent_serial}, n={len(self.token_ids)})"


class CacheEntry:
    """A registered (KV fully written) block; serials are never reused."""

    __slots__ = ("key", "serial", "block_id", "alive")

    def __init__(self, key: BlockKey, serial: int, block_id: int) -> None:
        self.key = key
        self.serial = serial
        self.block_id = block_id
        self.alive = True

    @property
    def hash_value(self) -> int:
        return self.key.hash_value


class BlockPool:
    """Fixed set of physical blocks ``0..num_blocks-1`` of one device (GPU or CPU)."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        # Head = evicted/reused first. Uncached free blocks go to the head so
        # cached ones survive as long as possible.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._entry: list[CacheEntry | None] = [None] * num_blocks
        self._cached: dict[BlockKey, CacheEntry] = {}
        self._next_serial = ROOT_SERIAL + 1
        self.num_evictions = 0

    # -- allocation -------------------------------------------------------
    def get_num_free(self) -> int:
        return len(self._free)

    def get_num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self) -> int:
        """Take the LRU free block (evicting its cache entry, if any) with ref count 1."""
        if not self._free:
            raise RuntimeError("out of KV blocks")
        block_id, _ = self._free.popitem(last=False)
        entry = self._entry[block_id]
        if entry is not None:
            self._evict(entry)
            self.num_evictions += 1
        self._ref[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Share a block (fork, cache hit, pin); a cached free block leaves the free list."""
        if self._ref[block_id] == 0:
            del self._free[block_id]
        self._ref[block_id] += 1

    def decref(self, block_id: int) -> None:
        ref = self._ref[block_id] - 1
        if ref < 0:
            raise AssertionError(f"double free of block {block_id}")
        self._ref[block_id] = ref
        if ref == 0:
            self._free[block_id] = None
            if self._entry[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    # -- prefix cache -----------------------------------------------------
    def lookup(self, key: BlockKey) -> CacheEntry | None:
        return self._cached.get(key)

    def register(self, block_id: int, key: BlockKey) -> CacheEntry | None:
        """Publish a computed block.

        Returns the existing entry when equal content is already cached (the
        duplicate block simply stays unpublished), or None if ``block_id`` is
        already published under a different key.
        """
        existing = self._cached.get(key)
        if existing is not None:
            return existing
        if self._entry[block_id] is not None:
            return None
        entry = CacheEntry(key, self._next_serial, block_id)
        self._next_serial += 1
        self._cached[key] = entry
        self._entry[block_id] = entry
        return entry

    def entry_of(self, block_id: int) -> CacheEntry | None:
        return self._entry[block_id]

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> None:
        """Forget every cache entry; blocks keep their ref counts, free ones become plain free."""
        for entry in list(self._cached.values()):
            self._evict(entry)

    def _evict(self, entry: CacheEntry) -> None:
        del self._cached[entry.key]
        self._entry[entry.block_id] = None
        entry.alive = False

    # -- checking ---------------------------------------------------------
    def check_invariants(self, expected_refs: Mapping[int, int]) -> None:
        """``expected_refs``: block id -> number of holders (tables + pins)."""
        assert len(self._ref) == self.num_blocks
        for b in range(self.num_blocks):
            ref = self._ref[b]
            want = expected_refs.get(b, 0)
            assert ref == want, f"block {b}: ref {ref} != holders {want}"
            assert (ref == 0) == (b in self._free), f"block {b}: free xor referenced violated"
        for b in expected_refs:
            assert 0 <= b < self.num_blocks, f"bad block id {b}"
        used = sum(1 for r in self._ref if r > 0)
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        for key, entry in self._cached.items():
            assert entry.alive and entry.key is key
            assert self._entry[entry.block_id] is entry, "cache map / block entry mismatch"
        assert sum(e is not None for e in self._entry) == len(self._cached)
