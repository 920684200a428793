"""`worker/host_heap.py`: CPU engines keep freed heap memory (glibc `mallopt`), unless
`PAGEDJAX_KEEP_HEAP=0`. Process-wide, so each case runs in a fresh interpreter; the check
reads glibc's own setting back (`malloc_info` lists `mmap` use) after a large allocation."""

import ctypes.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, ctypes.util, sys, numpy as np
from pagedjax.worker.host_heap import keep_freed_memory
print("set", keep_freed_memory())
big = np.ones(64 << 20, np.uint8)  # 64 MiB: glibc's default serves this with mmap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
print("mmapped", libc.mallinfo2().hblkhd >= (64 << 20))
"""

pytestmark = pytest.mark.skipif(
    "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""),
    reason="mallopt settings are glibc's")


@pytest.mark.parametrize("env,kept", [("1", True), ("0", False)])
def test_large_blocks_come_from_the_heap_only_when_kept(env, kept):
    assert ctypes.util.find_library("c")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "PAGEDJAX_KEEP_HEAP": env}, check=True).stdout
    assert f"set {kept}" in out
    assert f"mmapped {not kept}" in out


RELEASE = r"""
import numpy as np
from pagedjax.worker.host_heap import keep_freed_memory, release_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
keep_freed_memory()
arrays = [np.ones(3 << 20, np.uint8) for _ in range(100)]  # 300 MiB of heap blocks
keep = np.ones(1 << 20, np.uint8)  # above them: the heap's top cannot simply shrink
before = rss()
del arrays
freed = rss()
print("released", release_freed_memory())
print("drop_mib", (freed - rss()) >> 20, "kept_mib", (before - freed) >> 20)
"""


def test_release_gives_freed_heap_memory_back():
    """What `LLMEngine.from_model` does once the loaded weights are dropped: with freed memory
    kept (as on CPU engines), 300 MiB freed under a live block stays resident until
    `release_freed_memory`, which returns it."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                         env={**os.environ, "PAGEDJAX_KEEP_HEAP": "1"}, check=True).stdout
    assert "released True" in out
    fields = out.split()
    drop, kept = int(fields[fields.index("drop_mib") + 1]), int(fields[fields.index("kept_mib") + 1])
    assert kept < 50, out  # freeing alone returned (almost) nothing
    assert drop > 250, out
