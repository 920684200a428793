"""Physical KV block pool: ref counts, LRU free list and the prefix-cache map.

A block is either free (ref count 0, in the free list) or referenced, never
both. Free blocks that still hold a registered prefix-cache entry stay
reusable until the allocator evicts them from the head of the free list, so
the free list doubles as the LRU eviction order.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence

ROOT_SERIAL = 0  # parent "entry" of the first block of every sequence


@functools.lru_cache(maxsize=64)
def _ints(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


@functools.lru_cache(maxsize=4096)
def _extra_bytes(extra: tuple) -> bytes:
    # repr of a tuple of strings, ints and None is unambiguous (strings come quoted and
    # escaped); the cache is bounded, since salts come from clients.
    return repr(extra).encode()


def block_key(parent_serial: int, token_ids: Sequence[int], extra: tuple) -> bytes:
    """The prefix-cache key of one full block: its parent entry's serial, its token ids and
    its extra keys (cache salt, model, KV-cache group), packed into bytes.

    The key is the content itself, compared in full by the cache's dict, so two blocks share
    an entry only when their whole token prefixes are equal (by induction over the parent
    serials, which are never reused): a hash collision is a miss, never a wrong hit (tests
    replace this function with one whose keys all hash alike). The packing is injective:
    fixed-width ints, the token count first, then the `repr` of the extra keys.

    Bytes on purpose: the collector does not track them. A key object and an entry object per
    cached block made a steady decode step leave ~3 tracked objects per block it filled, so
    young collections came every ~200 steps at 256 sequences (1.3-2 ms each) and filled the
    older generations for their collections to walk (a middle one took 12-14 ms at 1024
    sequences). With bytes keys and int serials a decode step leaves nothing tracked behind
    (docs/v1-core.md "The prefix cache out of the collector's way")."""
    n = len(token_ids)
    return _ints(n + 2).pack(n, parent_serial, *token_ids) + _extra_bytes(extra)


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
        # The prefix cache. An entry is its serial number (an int: nothing for the collector
        # to walk, see `block_key`); serials are never reused, so a serial held by a
        # sequence's chain names that registration only, alive or evicted.
        self._cached: dict[bytes, int] = {}  # key -> serial
        self._block_of: dict[int, int] = {}  # serial -> block id, live entries only
        self._key_of: list[bytes | None] = [None] * num_blocks  # block id -> its key
        self._serial_of: list[int] = [ROOT_SERIAL] * num_blocks  # block id -> its serial
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
        if self._key_of[block_id] is not None:
            self._evict(block_id)
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
            if self._key_of[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    # -- prefix cache -----------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        """The serial of the entry cached under ``key`` (`block_key`), or None."""
        return self._cached.get(key)

    def register(self, block_id: int, key: bytes) -> int | None:
        """Publish a computed block under ``key``; returns its entry's serial.

        Returns the existing entry when equal content is already cached (the
        duplicate block simply stays unpublished), or None if ``block_id`` is
        already published under a different key.
        """
        existing = self._cached.get(key)
        if existing is not None:
            return existing
        if self._key_of[block_id] is not None:
            return None
        serial = self._next_serial
        self._next_serial += 1
        self._cached[key] = serial
        self._block_of[serial] = block_id
        self._key_of[block_id] = key
        self._serial_of[block_id] = serial
        return serial

    def block_of(self, serial: int) -> int:
        """The block of a live entry (KeyError once evicted: see `alive`)."""
        return self._block_of[serial]

    def alive(self, serial: int) -> bool:
        """Whether the entry is still cached (not evicted, not reset)."""
        return serial in self._block_of

    def entry_of(self, block_id: int) -> int | None:
        """The serial of the entry the block is published under, or None."""
        return self._serial_of[block_id] if self._key_of[block_id] is not None else None

    def key_of(self, block_id: int) -> bytes | None:
        """The key the block is published under (`block_key`), or None."""
        return self._key_of[block_id]

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> None:
        """Forget every cache entry; blocks keep their ref counts, free ones become plain free."""
        for block_id in list(self._block_of.values()):
            self._evict(block_id)

    def _evict(self, block_id: int) -> None:
        """Drop the entry the block is published under."""
        del self._cached[self._key_of[block_id]]
        del self._block_of[self._serial_of[block_id]]
        self._key_of[block_id] = None
        self._serial_of[block_id] = ROOT_SERIAL

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
        for key, serial in self._cached.items():
            b = self._block_of[serial]
            assert self._key_of[b] is key and self._serial_of[b] == serial, \
                "cache map / block entry mismatch"
        assert len(self._block_of) == len(self._cached)
        assert sum(k is not None for k in self._key_of) == len(self._cached)
