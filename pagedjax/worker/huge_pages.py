"""A CPU engine's weights on transparent huge pages (Linux), in one mapping JAX reads in place.

A decode step reads every weight once, so how fast memory answers is the step's speed at small
batches. XLA:CPU allocates each weight with `malloc` on 4 KiB pages; measured on this
project's 2-core VM host (`bench/cpu_floor.py`, docs/v1-core.md):

- one thread reading 540 MB (the demo model's fp32 weights) took ~41 ms on 4 KiB pages and
  ~35 ms on 2 MiB pages: fewer TLB misses, each of which a VM pays with a two-level walk;
- after the pages went untouched for a few seconds (between two requests, or while a peer
  engine ran in a side-by-side benchmark), the first pass over 4 KiB pages took 150-190 ms
  (the host re-validates each page on first touch, about 1 us a page), on 2 MiB pages 40-50.

So the runner copies its placed weights into one private anonymous mapping advised
`MADV_HUGEPAGE` before it is touched (each fault then takes a whole 2 MiB page) and puts
every leaf on the device from a view of it: the CPU client aliases a suitably aligned host
buffer instead of copying it, so the arrays the step reads are these pages. The views hold
the mapping, and JAX holds the views for as long as the arrays live.

Only for a single CPU device and only where the kernel offers THP (``enabled`` not
``never``); ``PAGEDJAX_HUGE_PAGES=0`` turns it off. If the client copies instead of
aliasing (another JAX), the original arrays are kept and nothing is gained or lost.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from pathlib import Path

import jax
import numpy as np

logger = logging.getLogger(__name__)

ENV = "PAGEDJAX_HUGE_PAGES"
HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each leaf page-aligned: more than the CPU client needs to alias it
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# (first byte, end, weakref to the arena's byte view): each leaf's view is a slice of that byte
# view, so it lives exactly as long as some placed array does.
_arenas: list[tuple[int, int, weakref.ref]] = []


def thp_available() -> bool:
    """The kernel gives huge pages to a mapping that asks (THP mode ``always`` or ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "False") and thp_available()


def place_on_huge_pages(tree, device: jax.Device | None = None):
    """``tree``'s arrays, copied into one huge-page mapping and placed (committed) on the CPU
    ``device`` (default: the first leaf's) as aliases of it; ``tree`` unchanged when THP is
    off, the leaves are not all single-device CPU arrays, or the client would copy."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or not enabled():
        return tree
    if not all(isinstance(x, jax.Array) and len(x.devices()) == 1 for x in leaves):
        return tree
    device = device or next(iter(leaves[0].devices()))
    if device.platform != "cpu" or any(next(iter(x.devices())) != device for x in leaves):
        return tree
    sizes = [-(-max(x.nbytes, 1) // _ALIGN) * _ALIGN for x in leaves]
    total = sum(sizes)
    # Private: a shared anonymous mapping is shmem, which THP's `enabled` does not cover.
    # Whole huge pages after the first boundary, however small the tree.
    arena = mmap.mmap(-1, -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: no later collapse needed
    whole = np.frombuffer(arena, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE  # first 2 MiB boundary: whole huge pages from there
    placed, offset = [], start
    for x, size in zip(leaves, sizes):
        view = whole[offset:offset + x.nbytes].view(x.dtype).reshape(x.shape)
        view[...] = np.asarray(x)
        y = jax.device_put(view, device)
        if x.size and y.unsafe_buffer_pointer() != view.ctypes.data:  # copied: keep the old
            logger.info("CPU client copies host buffers: weights stay on %s", "4 KiB pages")
            return tree
        placed.append(y)
        offset += size
    _arenas[:] = [a for a in _arenas if a[2]() is not None]
    _arenas.append((whole.ctypes.data, whole.ctypes.data + whole.nbytes, weakref.ref(whole)))
    return jax.tree.unflatten(treedef, placed)


def on_huge_pages(tree) -> bool:
    """Every array of ``tree`` lies in a mapping `place_on_huge_pages` made. Asked of the
    arrays themselves, not of /proc: under THP mode ``always`` any anonymous memory is
    eligible, and numpy advises its own large buffers, so neither flag singles ours out."""
    live = [(lo, hi) for lo, hi, ref in _arenas if ref() is not None]
    leaves = [x for x in jax.tree.leaves(tree) if x.size]
    return bool(leaves) and all(
        any(lo <= x.unsafe_buffer_pointer() < hi for lo, hi in live) for x in leaves)
