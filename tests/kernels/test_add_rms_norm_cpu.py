"""The native residual add + RMSNorm (`csrc/add_rms_norm_cpu.cc`, `cpu_native.add_rms_norm_native`)
against float64 numpy over a sweep of shapes: hidden sizes that are and are not whole vectors,
row counts under and over the point where helpers join, with and without the add; rows stay
independent (a non-finite row spoils only itself). `cpu_native.add_rms_norm_cpu`, the model's
norm, calls it up to `NATIVE_NORM_MAX_ROWS` rows and the jnp reference past that and for other
dtypes; bad shapes are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_native
from pallas_kernels.add_rms_norm import add_rms_norm_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")

EPS = 1e-6


def _want(x, delta, w, eps=EPS):
    r = x.astype(np.float32) if delta is None else (x + delta).astype(np.float32)
    r64 = r.astype(np.float64)
    h = r64 / np.sqrt((r64 * r64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
    return r, h


@pytest.mark.parametrize("rows", [1, 7, 64, 1100])
@pytest.mark.parametrize("hidden", [17, 64, 576, 1000])
@pytest.mark.parametrize("add", [True, False], ids=["add", "norm"])
def test_matches_float64(rows, hidden, add):
    rng = np.random.default_rng(rows * 7919 + hidden + add)
    x = (rng.standard_normal((rows, hidden)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    delta = rng.standard_normal((rows, hidden)).astype(np.float32) if add else None
    w = rng.uniform(-2, 2, hidden).astype(np.float32)
    r, h = jax.jit(lambda x, d, w: cpu_native.add_rms_norm_native(x, d, w, EPS))(x, delta, w)
    want_r, want_h = _want(x, delta, w)
    np.testing.assert_array_equal(np.asarray(r), want_r)  # the float32 sum, exactly
    # Each output within a few float32 roundings of its float64 value (|h| <~ |w| * sqrt(H)).
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=4e-6, atol=4e-6 * np.abs(w).max())


def test_leading_axes_and_a_bad_row_stays_in_its_row():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    delta = rng.standard_normal((2, 3, 40)).astype(np.float32)
    x[1, 2, 5] = np.inf
    x[0, 1, 9] = np.nan
    w = np.ones(40, np.float32)
    r, h = cpu_native.add_rms_norm_native(jnp.asarray(x), jnp.asarray(delta), jnp.asarray(w),
                                          EPS)
    assert r.shape == h.shape == (2, 3, 40)
    h = np.asarray(h)
    bad = np.zeros((2, 3), bool)
    bad[1, 2] = bad[0, 1] = True
    assert np.isnan(h[bad]).any(axis=-1).all()
    _, want = _want(x[~bad], delta[~bad], w)
    np.testing.assert_allclose(h[~bad], want, rtol=4e-6, atol=4e-6)


def _calls_native(fn, *args) -> bool:
    return cpu_native.ADD_RMS_NORM_TARGET in str(jax.jit(fn).lower(*args).as_text())


def test_the_model_norm_is_native_up_to_its_row_limit():
    w = jnp.ones(32, jnp.float32)
    norm = lambda x, d: cpu_native.add_rms_norm_cpu(x, d, w, EPS)  # noqa: E731
    limit = cpu_native.NATIVE_NORM_MAX_ROWS
    small = jnp.ones((2, limit // 2, 32), jnp.float32)
    big = jnp.ones((limit + 1, 32), jnp.float32)
    assert _calls_native(norm, small, small)
    assert not _calls_native(norm, big, big)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((limit + 1, 32)), jnp.float32)
    for g, t in zip(norm(x, x), add_rms_norm_ref(x, x, w, EPS)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(t))


def test_other_dtypes_take_the_reference():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
    delta = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 32), jnp.bfloat16)
    got = cpu_native.add_rms_norm_cpu(x, delta, w, EPS)
    want = add_rms_norm_ref(x, delta, w, EPS)
    for g, t in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(t, np.float32))


def test_bad_shapes_are_refused_by_name():
    x = jnp.zeros((3, 8), jnp.float32)
    with pytest.raises(ValueError, match="weight shape"):
        cpu_native.add_rms_norm_cpu(x, None, jnp.ones(7, jnp.float32), EPS)
    with pytest.raises(ValueError, match="delta shape"):
        cpu_native.add_rms_norm_cpu(x, jnp.zeros((3, 9), jnp.float32), jnp.ones(8, jnp.float32),
                                    EPS)
