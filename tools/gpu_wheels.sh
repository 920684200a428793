#!/usr/bin/env bash
# Download into .whl/ the wheels the GPU suite needs beyond the lent machine's image
# (docs/gpu.md; the image's package list is in the device tool's KINDS.md). Carry `.whl` in
# the device call; tools/gpu_bootstrap.sh installs them into /tmp/site there.
#
# What the suite imports beyond the standard library: jax (+ the CUDA plugin), flax, numpy,
# ml_dtypes, pytest (the kernels stage) and matplotlib-free bench code -- all in the image. The
# engine's gguf / grpc / fastapi / tokenizer imports are not on the suite's path (seeded
# weights, token-id prompts), so today nothing has to travel and WHEELS is empty. Add a
# `NAME==VERSION` below if a new import is added; pure-python wheels are `py3-none-any`.
# Check with: .venv/bin/python tools/gpu_wheels.sh --check  (lists the non-stdlib modules a
# dry run imports, to compare against the image list).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
)

if [ "${1:-}" = "--check" ]; then
    # Every stage's code in one CPU process (the paper run and the kernel tests in-process
    # too), then the non-stdlib top-level modules it imported.
    exec env JAX_PLATFORMS=cpu PYTHONPATH=. "${PYTHON:-.venv/bin/python}" - <<'PY'
import glob, importlib, sys, tempfile
from pathlib import Path
from bench.gpu_suite.__main__ import DRY_BUDGET_S, run_stage_in_process
from bench.gpu_suite.stage_paper import command
with tempfile.TemporaryDirectory() as d:
    for stage in ("bench", "e2e"):
        run_stage_in_process(stage, Path(d), DRY_BUDGET_S[stage], True)
    import bench.paper.run
    bench.paper.run.main(command(Path(d), True, "cpu")[3:])
for f in sorted(glob.glob("tests/kernels/test_*.py")):
    importlib.import_module(f[:-3].replace("/", "."))
mods = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - {"__main__"})
print("gpu_wheels: non-stdlib modules imported:", " ".join(m for m in mods if not m.startswith("_")))
PY
fi

mkdir -p .whl
if [ "${#WHEELS[@]}" -eq 0 ]; then
    echo "gpu_wheels: the suite needs no wheel beyond the device image; .whl/ left empty"
    exit 0
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
du -sh .whl
