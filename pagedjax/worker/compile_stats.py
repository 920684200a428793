"""Counts XLA backend compilations in this process (JAX's own monitoring event), and the
memory mappings compiled CPU code holds.

Used to show that steady-state serving and weight swaps never recompile: jit cache sizes
over-count (a committed and an uncommitted argument make two entries for one executable).
"""

from __future__ import annotations

from pathlib import Path

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0


def _on_event(event: str, duration_secs: float, **_: object) -> None:
    global _count
    if event == _EVENT:
        _count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def num_backend_compiles() -> int:
    return _count


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit
    ``vm.max_map_count``), or None where /proc does not say (not Linux).

    XLA:CPU maps each compiled kernel's code, constants and data on pages of their own, three
    mappings a kernel (~100 kernels for the full sampler), and aborts the whole process
    ("LLVM ERROR: Unable to allocate section memory") once the limit is reached: 65530 by
    default, which ~200 sampler executables alone used to fill (`LLMEngine.warmup`)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None
    return used, limit
