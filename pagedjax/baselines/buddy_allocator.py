"""Binary buddy allocator over a pool of KV blocks (the contiguous baselines' allocator).

Paper §3.1: pre-allocating systems keep each request's KV cache in one contiguous
chunk obtained from an allocator "like the buddy allocator"; rounding every chunk
up to a power of two and being unable to merge non-buddy neighbours is the
*external fragmentation* of Fig. 2. This allocator makes that fragmentation real
on the same block pool the paged engine uses.

A pool whose size is not a power of two is split into maximal aligned power-of-two
top-level chunks (e.g. 48 blocks = [0, 32) + [32, 48)); buddies never merge across
top-level chunks.
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


class BuddyAllocator:
    """Allocates aligned power-of-two runs of block ids in [0, num_blocks)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free: dict[int, set[int]] = {}  # order -> start offsets of free runs
        self._allocated: dict[int, int] = {}  # start -> order
        self._top: dict[int, int] = {}  # start of each top-level chunk -> its order
        start = 0
        while start < num_blocks:
            order = (num_blocks - start).bit_length() - 1
            # Alignment holds because earlier chunks are strictly larger powers of two.
            self._top[start] = order
            self._free.setdefault(order, set()).add(start)
            start += 1 << order
        self.max_order = max(self._top.values())

    # -- queries ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return sum(len(s) << o for o, s in self._free.items())

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - self.num_free

    def largest_free_run(self) -> int:
        orders = [o for o, s in self._free.items() if s]
        return 1 << max(orders) if orders else 0

    def can_allocate(self, num_blocks: int) -> bool:
        return next_pow2(max(1, num_blocks)) <= self.largest_free_run()

    def fits_ever(self, num_blocks: int) -> bool:
        """Whether a run of this size fits in the empty pool at all."""
        return next_pow2(max(1, num_blocks)) <= 1 << self.max_order

    def size_of(self, start: int) -> int:
        return 1 << self._allocated[start]

    # -- alloc/free -------------------------------------------------------------
    def allocate(self, num_blocks: int) -> int:
        """Start of a free aligned run of next_pow2(num_blocks) blocks (lowest address first)."""
        want = next_pow2(max(1, num_blocks)).bit_length() - 1
        order = want
        while order <= self.max_order and not self._free.get(order):
            order += 1
        if order > self.max_order:
            raise MemoryError(f"no free run of {1 << want} blocks (largest {self.largest_free_run()})")
        start = min(self._free[order])
        self._free[order].discard(start)
        while order > want:  # split, keeping the low half and freeing the high buddy
            order -= 1
            self._free.setdefault(order, set()).add(start + (1 << order))
        self._allocated[start] = want
        return start

    def free(self, start: int) -> None:
        """Return a run and merge it with its free buddies as far as possible."""
        order = self._allocated.pop(start)
        while True:
            top = self._top_of(start)
            if order >= self._top[top]:
                break
            buddy = top + ((start - top) ^ (1 << order))
            peers = self._free.get(order)
            if not peers or buddy not in peers:
                break
            peers.discard(buddy)
            start = min(start, buddy)
            order += 1
        self._free.setdefault(order, set()).add(start)

    def _top_of(self, start: int) -> int:
        best = 0
        for t in self._top:
            if t <= start:
                best = max(best, t)
        return best

    # -- checking -----------------------------------------------------------------
    def check_invariants(self) -> None:
        """Free and allocated runs tile the pool exactly; no two free buddies left unmerged."""
        runs = [(s, 1 << o) for o, ss in self._free.items() for s in ss]
        runs += [(s, 1 << o) for s, o in self._allocated.items()]
        runs.sort()
        pos = 0
        for s, n in runs:
            assert s == pos, f"gap or overlap at block {pos} (run starts at {s})"
            top = self._top_of(s)
            assert (s - top) % n == 0, f"run at {s} of {n} blocks misaligned"
            pos += n
        assert pos == self.num_blocks, "runs do not cover the pool"
        for o, ss in self._free.items():
            for s in ss:
                top = self._top_of(s)
                if o < self._top[top]:
                    assert top + ((s - top) ^ (1 << o)) not in ss, f"free buddies {s} unmerged"
