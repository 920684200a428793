"""Launch parameters of the attention kernels, per GPU architecture and shape class.

The kernels take ``num_warps``, ``num_stages``, ``chunk_tokens`` (KV tokens per inner-loop
step) and, for the ragged kernel, ``q_rows`` (query rows per program: query tokens times the
padded GQA group). Defaults come from
this table instead of constants because the right values depend on the chip (shared memory
per SM, registers) and on the tile's bytes (head_dim x dtype): a 64-token chunk of fp32 K and
V at head_dim 256 is 128 KiB per pipeline stage, more than an A100 has.

Every entry is checked by the deviceless compile tier (``python -m pagedjax.aot``, run in
``make test``): it compiles each configuration the engine can pick for H100 and A100 and
fails on spills or shared-memory overflow. The GPU suite (``make gpu-suite STAGE=bench``)
re-tunes the table from timings; ``PAGEDJAX_TUNING_FILE`` points at such a measured JSON
(rows ``{arch, kernel, itemsize, head_dim, num_warps, num_stages, chunk_tokens, q_rows}``),
whose rows override the built-in ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np
from jax._src import mesh as mesh_lib

ENV_TUNING_FILE = "PAGEDJAX_TUNING_FILE"


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    num_warps: int
    num_stages: int
    chunk_tokens: int  # KV tokens per inner-loop step (a power of two >= 16)
    q_rows: int = 0  # ragged only: query rows per program = block_q * padded GQA group


def target_device_kind() -> str:
    """Device kind of the lowering target (abstract mesh, default-device context, backend)."""
    abstract_device = mesh_lib.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.device_kind or ""
    default = jax.config.jax_default_device
    if default is not None and not isinstance(default, str):
        return default.device_kind
    return jax.devices()[0].device_kind


def arch_of(device_kind: str) -> str:
    """Architecture class: sm90 (H100/H200/GH200), sm100 (B200/GB200), sm80 (A100/A10/A30/L4
    class) or generic. Anything we cannot place gets conservative sm80-sized tiles."""
    kind = device_kind.upper()
    if re.search(r"\b(H100|H200|H800|H20|GH200)\b", kind):
        return "sm90"
    if re.search(r"\b(B100|B200|GB200|B300|GB300)\b", kind):
        return "sm100"
    return "sm80" if "NVIDIA" in kind else "generic"


# (kernel, itemsize, head_dim) -> tuning, per architecture, as found by
# `python -m pagedjax.aot.tune --target h100|a100`: the first launch in preference order
# (bigger KV chunk, more query rows, more pipeline stages, fewer warps) that compiles with no
# register spills and within shared memory at block sizes 16 and 256. Compile-clean, not yet
# timed: the GPU suite's bench stage re-ranks by measured time. fp32 caches (exact, non-TF32
# dots on CUDA cores) only fit one stage. bench/results/aot-*/report.json has every
# configuration's registers and shared memory.
_SM90 = {
    ("decode", 2, 64): KernelTuning(4, 3, 128),
    ("decode", 2, 128): KernelTuning(4, 3, 128),
    ("decode", 2, 256): KernelTuning(8, 3, 128),
    ("decode", 4, 64): KernelTuning(8, 1, 128),
    ("decode", 4, 128): KernelTuning(8, 1, 32),
    ("decode", 4, 256): KernelTuning(8, 1, 64),
    ("ragged", 2, 64): KernelTuning(4, 3, 128, 64),
    ("ragged", 2, 128): KernelTuning(4, 3, 128, 64),
    ("ragged", 2, 256): KernelTuning(8, 2, 128, 32),
    ("ragged", 4, 64): KernelTuning(8, 1, 128, 32),
    ("ragged", 4, 128): KernelTuning(8, 1, 64, 32),
    ("ragged", 4, 256): KernelTuning(8, 1, 64, 16),
}
_SM80 = {
    ("decode", 2, 64): KernelTuning(4, 3, 128),
    ("decode", 2, 128): KernelTuning(4, 3, 128),
    ("decode", 2, 256): KernelTuning(8, 3, 128),
    ("decode", 4, 64): KernelTuning(8, 1, 128),
    ("decode", 4, 128): KernelTuning(8, 1, 64),
    ("decode", 4, 256): KernelTuning(8, 1, 64),
    ("ragged", 2, 64): KernelTuning(4, 3, 128, 64),
    ("ragged", 2, 128): KernelTuning(8, 3, 128, 64),
    ("ragged", 2, 256): KernelTuning(8, 3, 128, 32),
    ("ragged", 4, 64): KernelTuning(8, 1, 128, 32),
    ("ragged", 4, 128): KernelTuning(8, 1, 64, 32),
    ("ragged", 4, 256): KernelTuning(8, 1, 64, 16),
}
TABLE: dict[str, dict[tuple[str, int, int], KernelTuning]] = {
    "sm90": _SM90, "sm100": _SM90, "sm80": _SM80, "generic": _SM80,
}


def quantized_launch(tuned: KernelTuning) -> KernelTuning:
    """The launch of a kernel over an int8 / FP8 cache: the tuned one with half the KV chunk
    (at least 32 tokens) and, for the ragged kernel, half the query rows (at least 16). The
    widening of 1-byte tiles to the query dtype costs registers the float launch does not
    have: at the tuned launch 28 of the quantized sweep's kernels spilled (sm_90a head_dim 256,
    sm_80 head_dim 64); with this rule none do (`make aot-report`)."""
    return dataclasses.replace(tuned, chunk_tokens=max(32, tuned.chunk_tokens // 2),
                               q_rows=max(16, tuned.q_rows // 2) if tuned.q_rows else 0)


@functools.cache
def _measured(path: str) -> dict[tuple[str, str, int, int], KernelTuning]:
    rows = json.loads(open(path).read())
    return {
        (r["arch"], r["kernel"], int(r["itemsize"]), int(r["head_dim"])): KernelTuning(
            int(r["num_warps"]), int(r["num_stages"]), int(r["chunk_tokens"]),
            int(r.get("q_rows", 0)))
        for r in rows
    }


def lookup(kernel: str, dtype, head_dim: int, arch: str | None = None) -> KernelTuning:
    """Tuning for ``kernel`` ("decode" | "ragged") at this cache dtype and head_dim.

    Head dims between the table's classes use the next larger class (bigger tiles are the
    constraint), so a head_dim 96 model gets the head_dim 128 entry.
    """
    if kernel not in ("decode", "ragged"):
        raise ValueError(f"unknown kernel {kernel!r}")
    arch = arch or arch_of(target_device_kind())
    itemsize = 4 if np.dtype(dtype).itemsize >= 4 else 2
    dim_class = next((d for d in (64, 128, 256) if head_dim <= d), 256)
    path = os.environ.get(ENV_TUNING_FILE)
    if path:
        hit = _measured(path).get((arch, kernel, itemsize, dim_class))
        if hit is not None:
            return hit
    return TABLE.get(arch, _SM80)[(kernel, itemsize, dim_class)]
