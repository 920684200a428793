"""The native panel matmul's take-over mode (`pallas_kernels/csrc/dense_matmul_cpu.cc`,
`Shared`; PAGEDJAX_MATMUL_TAKE_OVER=1): with every helper made to sleep 40 ms before committing
each work item (PAGEDJAX_MATMUL_HELPER_STALL_US, the stand-in for a thread the OS preempted),
calls return in a fraction of that, the caller taking over the helpers' items, and every
result, including those of calls made while earlier calls' helpers are still asleep, matches
float64 numpy and, bit for bit, the same product computed with no stall; so does the default
direct mode, which waits; and so does the gate/up matmul with its silu * up epilogue. Runs in
subprocesses: the kernel reads its settings once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")

REPO = Path(__file__).resolve().parents[2]
STALL_US = 40_000
# (rows, depth, width): grouped panels (1-3 rows), one row chunk, several chunks, and a
# partial last panel.
SHAPES = [(1, 576, 960), (2, 300, 640), (3, 128, 64 * 9 + 5), (6, 576, 1536), (64, 576, 960),
          (130, 200, 64 * 7)]
# The gated matmul's (rows, depth, gate + up width): grouped panels and row chunks.
GATED_SHAPES = [(1, 576, 3072), (3, 128, 512), (64, 576, 1024), (130, 200, 256)]

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from models.qlinear import to_dense_panels
    from pallas_kernels import cpu_native
    mm = jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)
    out = []
    for rep in range(3):
        for i, (m, k, n) in enumerate(json.loads(sys.argv[1])):
            rng = np.random.default_rng(100 * rep + i)
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = rng.standard_normal((k, n)).astype(np.float32)
            panels = to_dense_panels(jnp.asarray(w))
            xj = jnp.asarray(x)
            jax.block_until_ready(mm(xj, panels, n))  # compiled before the timed call
            t = time.perf_counter()
            y = np.asarray(jax.block_until_ready(mm(xj, panels, n)))
            ms = 1e3 * (time.perf_counter() - t)
            want = x.astype(np.float64) @ w.astype(np.float64)
            tol = 4 * np.sqrt(k) * np.finfo(np.float32).eps * np.abs(x).max() * np.abs(w).max()
            out.append({"ms": ms, "sum": float(y.astype(np.float64).sum()),
                        "hash": hashlib.sha256(y.tobytes()).hexdigest(),
                        "err": float(np.abs(y.astype(np.float64) - want).max()), "tol": float(tol)})
    # The gated call (silu(gate) * up in the epilogue): helpers' items through scratch too.
    gated = jax.jit(lambda x, w, n: cpu_native.dense_matmul_cpu(x, w, n, None, True),
                    static_argnums=2)
    for rep in range(3):
        for i, (m, k, n) in enumerate(json.loads(sys.argv[2])):
            rng = np.random.default_rng(1000 + 100 * rep + i)
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
            panels = to_dense_panels(jnp.asarray(w))
            xj = jnp.asarray(x)
            jax.block_until_ready(gated(xj, panels, n))
            t = time.perf_counter()
            y = np.asarray(jax.block_until_ready(gated(xj, panels, n)))
            ms = 1e3 * (time.perf_counter() - t)
            full = x.astype(np.float64) @ w.astype(np.float64)
            g, u = full[:, :n // 2], full[:, n // 2:]
            want = g / (1 + np.exp(-g)) * u
            tol = (8 * np.sqrt(k) * np.finfo(np.float32).eps * np.abs(x).max() * np.abs(w).max()
                   * (1 + np.abs(u).max()) + 1e-6 * np.abs(want).max())
            out.append({"ms": ms, "sum": float(y.astype(np.float64).sum()),
                        "hash": hashlib.sha256(y.tobytes()).hexdigest(),
                        "err": float(np.abs(y.astype(np.float64) - want).max()), "tol": float(tol)})
    print(json.dumps(out))
""")


def _run(stall_us: int, take_over: str | None = None) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "PAGEDJAX_MATMUL_HELPER_STALL_US": str(stall_us)}
    env.pop("PAGEDJAX_MATMUL_TAKE_OVER", None)
    if take_over is not None:
        env["PAGEDJAX_MATMUL_TAKE_OVER"] = take_over
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SHAPES),
                           json.dumps(GATED_SHAPES)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="helpers need a second intra-op thread")
def test_taking_over_does_not_wait_for_stalled_helpers():
    """PAGEDJAX_MATMUL_TAKE_OVER=1: calls do not wait out a stalled helper; unset (direct, the
    default), they do (so the stand-in does stall a waiting caller). Same bits in every case."""
    quiet = _run(0)
    runs = {mode: _run(STALL_US, mode) for mode in ("1", None)}
    for mode, stalled in runs.items():
        assert len(stalled) == len(quiet) == 3 * (len(SHAPES) + len(GATED_SHAPES)), mode
        for q, s in zip(quiet, stalled, strict=True):
            assert s["err"] <= s["tol"] and q["err"] <= q["tol"]
            # Whoever computed an item, in either mode, the bits are the same.
            assert s["hash"] == q["hash"] and s["sum"] == q["sum"], mode
    # Waiting for a helper costs at least one 40 ms stall per call; taking over does not
    # (a few calls may still meet a helper mid-commit, hence the median).
    stall_ms = STALL_US / 1e3
    assert np.median([s["ms"] for s in runs["1"]]) < stall_ms / 4
    # Direct: calls whose helper claimed an item in time wait out its stall.
    assert max(s["ms"] for s in runs[None]) >= stall_ms
