"""Keep freed heap memory in the process instead of giving it back to the OS (CPU engines).

XLA:CPU allocates every step's large buffers with `malloc`: the logits and the sampler's
`[rows, vocab]` temporaries are 50 MB each at 256 rows of a 49k vocabulary. glibc serves
allocations that large with a fresh `mmap` and unmaps them on free, so every step touches
every page of them anew, one page fault per 4 KiB. On this project's 2-core CPU that made
`log_softmax` over [256, 49152] take 34.9 ms instead of 8.4 ms, and the whole engine 8-11 %
slower on batched runs (`bench/sampler.py`; `bench/offline_throughput.py --engines
pagedjax,pagedjax-heap-off`).
vLLM's CPU backend avoids it by preloading tcmalloc; here `mallopt` does the same in-process:
no `mmap` for large blocks (they come from the heap and are reused) and no trimming of the
heap's top. The price is that the process keeps its peak heap, as with tcmalloc.

Process-wide and permanent, so only engines on the CPU platform turn it on
(`PAGEDJAX_KEEP_HEAP=0`: never).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

ENV = "PAGEDJAX_KEEP_HEAP"
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory() -> bool:
    """Turn off `mmap` for large allocations and heap trimming (glibc only); True when set."""
    if os.environ.get(ENV, "1") in ("0", "false", "False"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        logger.warning("mallopt refused; large CPU buffers are page-faulted every step")
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc `malloc_trim`): after loading,
    the checkpoint's arrays and their transient copies are freed in the middle of the heap,
    which `keep_freed_memory`'s settings would otherwise keep as resident memory for the
    process's life. True when it ran."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
