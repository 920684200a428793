"""Search the launch parameters that compile cleanly for a target (no spills, smem fits).

Without a GPU we cannot time, but we can rule out every configuration that spills registers
or would not launch, and order the rest by a simple preference (bigger KV chunks, then
deeper pipelining, then fewer warps). The result seeds :data:`pallas_kernels.tuning.TABLE`;
the GPU suite re-orders the feasible set by measured time.

    JAX_PLATFORMS=cpu TF_CPP_VMODULE=nvjitlink=3 TF_CPP_MIN_LOG_LEVEL=0 \\
        python -m pagedjax.aot.tune --target h100
"""

from __future__ import annotations

import argparse
import itertools
import json

from pagedjax.aot.kernel_sweep import KernelCase, compile_case
from pagedjax.aot.target import compile_only_devices
from pallas_kernels import tuning

CHUNKS = (128, 64, 32, 16)
WARPS = (4, 8)
STAGES = (3, 2, 1)
RAGGED_ROWS = (64, 32, 16)


def _clean(case: KernelCase, target: str, arch: str) -> bool:
    entry = compile_case(case, target, arch)
    return all(r["error"] is None and r["kernels"]
               and all(k["spill_stores"] + k["spill_loads"] == 0 for k in r["kernels"])
               for r in entry["rows"])


def search(target: str, kernel: str, dtype: str, head_dim: int, log=print) -> dict | None:
    """First clean candidate in preference order, checked at block sizes 16 and 256 and GQA
    groups 1 and 8 (one query token per row vs eight rows per token: the same tile size
    allocates differently; group 1 spilled on sm_80 where group 8 did not)."""
    arch = tuning.arch_of(compile_only_devices(target)[0].device_kind)
    rows = RAGGED_ROWS if kernel == "ragged" else (0,)
    for chunk, r, stages, warps in itertools.product(CHUNKS, rows, STAGES, WARPS):
        launch = tuning.KernelTuning(warps, stages, chunk, r)
        ok = all(_clean(KernelCase(kernel, dtype, head_dim, bs, g, launch), target, arch)
                 for bs in (16, 256) for g in (1, 8))
        log(f"{target} {kernel} {dtype} d={head_dim} {launch}: {'ok' if ok else 'no'}")
        if ok:
            return dict(arch=arch, kernel=kernel, itemsize=4 if dtype == "float32" else 2,
                        head_dim=head_dim, num_warps=warps, num_stages=stages,
                        chunk_tokens=chunk, q_rows=r)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--kernels", default="decode,ragged")
    args = parser.parse_args()
    found = []
    for kernel in args.kernels.split(","):
        for dtype, d in itertools.product(("bfloat16", "float32"), (64, 128, 256)):
            found.append(search(args.target, kernel, dtype, d) or
                         dict(kernel=kernel, dtype=dtype, head_dim=d, error="nothing clean"))
            print(json.dumps(found[-1]), flush=True)


if __name__ == "__main__":
    main()
