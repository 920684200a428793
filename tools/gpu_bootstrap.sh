#!/usr/bin/env bash
# First thing a lent-GPU command does (docs/gpu.md). Either source it:
#     source tools/gpu_bootstrap.sh && python3 -m bench.gpu_suite --stage kernels,bench --out $OUT
# or hand it the command, which then runs with the environment set up:
#     bash tools/gpu_bootstrap.sh python3 -m bench.gpu_suite --stage e2e --out $OUT
# (`bash tools/gpu_bootstrap.sh && python3 ...` installs the wheels but loses the exports.)
#
# Installs the wheels carried in .whl/ (tools/gpu_wheels.sh) into /tmp/site, puts the repo root
# and /tmp/site on PYTHONPATH, makes Python unbuffered (a command killed at its limit still
# shows what it printed), lets JAX allocate GPU memory on demand (the suite runs pytest and the
# paper benchmark as processes beside its own), and prints the versions the suite relies on.

_gpu_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_gpu_site=/tmp/site
_gpu_fail() { echo "gpu_bootstrap: $*" >&2; return 1 2>/dev/null || exit 1; }

if compgen -G "$_gpu_repo/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$_gpu_site" "$_gpu_repo"/.whl/*.whl || _gpu_fail "installing .whl/*.whl failed"
fi
if [ -d "$_gpu_site" ]; then
    export PYTHONPATH="$_gpu_repo:$_gpu_site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$_gpu_repo${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$_gpu_repo" || _gpu_fail "cannot cd to $_gpu_repo"

python3 - <<'PY' || _gpu_fail "the suite's imports fail here"
import importlib.metadata as md
import jax, flax, numpy  # noqa: F401  (the suite's non-stdlib needs on the device image)
vers = {n: md.version(n) for n in ("jax", "jaxlib", "flax", "numpy", "pytest")}
print("gpu_bootstrap:", ", ".join(f"{k} {v}" for k, v in vers.items()), "| devices", jax.devices())
PY

if [ "$#" -gt 0 ]; then
    exec "$@"
fi
