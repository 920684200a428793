"""Counts XLA backend compilations in this process (JAX's own monitoring event).

Used to show that steady-state serving and weight swaps never recompile: jit cache sizes
over-count (a committed and an uncommitted argument make two entries for one executable).
"""

from __future__ import annotations

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
