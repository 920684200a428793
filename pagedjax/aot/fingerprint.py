"""What a deviceless compile depends on, as short digests: the lowered IR and the toolchain.

A compile's registers, spills and shared memory are a function of the lowered module (the
StableHLO with each Pallas kernel's Triton/Mosaic IR embedded in it), the target's
``GpuTargetConfig`` and the compiler versions. The compile tier records the first as one
digest per compile (``ir``) and the rest once per report (:func:`toolchain`), so a check
can tell which committed rows still describe today's code by lowering alone, which takes a
fraction of a second per kernel where ptxas takes seconds, and compile only a sample to
confirm the toolchain reproduces the report (``pagedjax.aot.report.verify``).

Lowering runs with no source locations (:func:`strip_locations`): JAX stamps each op of a
Pallas kernel with the Python file and line that traced it, so an edited comment above a
kernel, or a clone at another path, would change a digest whose compile is the same.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md

import jax

from pagedjax.aot.target import target_config

# The packages whose versions decide what a compile produces.
TOOLCHAIN_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "nvidia-cuda-nvcc", "nvidia-nvjitlink")


def strip_locations() -> None:
    """Lower every later module without file/line locations (process-wide; the compile tier
    runs in a process of its own), leaving op names only.

    Pallas-Triton stamps ops with the traceback (its length capped by the limit); Mosaic GPU
    with the innermost "user" frame, so every file is declared a non-user one (a private
    jax hook: if it goes away, tests/aot/test_fingerprint.py fails)."""
    from jax._src import source_info_util

    jax.config.update("jax_traceback_in_locations_limit", 0)
    source_info_util.register_exclusion("/")


def digest(lowered) -> str:
    """16 hex digits of the lowered module's text (Triton/Mosaic IR included)."""
    return _sha(lowered.as_text())


def toolchain(target: str) -> dict:
    """Compiler versions and the target config's digest: equal toolchains and equal IR
    digests give equal compiles."""
    return dict(versions={p: md.version(p) for p in TOOLCHAIN_PACKAGES},
                target_config_sha=_sha(target_config(target)))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
