"""`bench/native_ab.py`: a kernel source built into its own library under a renamed FFI
handler computes what the engine's build computes (the A/B runs compare two such builds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qlinear import to_dense_panels
from pallas_kernels import cpu_native

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C++ compiler")


def _native_ab():
    spec = importlib.util.spec_from_file_location("native_ab", ROOT / "bench/native_ab.py")
    native_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native_ab)
    return native_ab


def _renamed_build(native_ab, kind: str, tag: str, tmp_path):
    """`native_ab.build` of the working tree's source for ``kind``: (lib, renamed symbol)."""
    name, symbol = native_ab.FILES[kind]
    source = (ROOT / "pallas_kernels/csrc" / name).read_text()
    return native_ab.build(source, symbol, tag, tmp_path)


def test_a_renamed_build_matches_the_engines_kernel(tmp_path):
    native_ab = _native_ab()
    symbol = native_ab.FILES["matmul"][1]
    lib, renamed = _renamed_build(native_ab, "matmul", "test", tmp_path)
    assert renamed == f"{symbol}_test" and f"{symbol}_test" in (tmp_path / "test.cc").read_text()
    jax.ffi.register_ffi_target("native_ab_test", jax.ffi.pycapsule(getattr(lib, renamed)),
                                platform="cpu")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((9, 100)), jnp.float32)
    w = to_dense_panels(jnp.asarray(rng.standard_normal((100, 130)), jnp.float32))
    got = jax.ffi.ffi_call("native_ab_test", jax.ShapeDtypeStruct((9, 130), jnp.float32))(x, w)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(cpu_native.dense_matmul_cpu(x, w, 130)))


def test_the_lm_head_workload_checks_tokens_against_float64(tmp_path):
    """`--kind lm_head`: the renamed screened head gives the float64 argmax of the workload's
    head (the workload exits on a difference), and so does the engine's build."""
    native_ab = _native_ab()
    lib, renamed = _renamed_build(native_ab, "lm_head", "head", tmp_path)
    jax.ffi.register_ffi_target("native_ab_head", jax.ffi.pycapsule(getattr(lib, renamed)),
                                platform="cpu")
    timed, meta = native_ab.lm_head_workload(20)  # AMX's path (from 4 rows), a partial tile
    assert meta == {"rows": 20, "head": [49152, 576]}
    got = np.asarray(timed("native_ab_head")())
    assert cpu_native.available()  # registers the engine's own targets
    engines = np.asarray(timed(cpu_native.LM_HEAD_GREEDY_TARGET)())
    np.testing.assert_array_equal(got, engines)
    assert got.shape == (20,) and len(set(got.tolist())) > 10  # distinct rows, distinct tokens
