"""The MLP's gate and up projections with silu(gate) * up in the native matmul's epilogue
(`pallas_kernels/csrc/dense_matmul_cpu.cc`, `dense_matmul_cpu(..., silu_mul=True)`): against
the unfused panel matmul's own gate and up (bit for bit the same products) and silu in float64
over row counts around the register block, work items and grouped panels; gates on both
tails, zero, inf and NaN; rows past `live` zeros whatever the padding holds; bad arguments
refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qlinear import to_dense_panels
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")

_mm = jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)
_gated = jax.jit(lambda x, w, n, live: cpu_native.dense_matmul_cpu(x, w, n, live, True),
                 static_argnums=2)


def _silu_mul64(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g, u = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return g / (1 + np.exp(-g)) * u


def _check(got: np.ndarray, g: np.ndarray, u: np.ndarray) -> None:
    """Within 4 float32 ulps of float64 silu(g) * u (of the same float32 g, u); values below
    1e-35 within that absolutely (a sigmoid of e^-87 is subnormal, and XLA's threads flush
    those to zero)."""
    want = _silu_mul64(g, u)
    fin = np.isfinite(want)
    err = np.abs(got[fin].astype(np.float64) - want[fin])
    assert np.all(err <= 4 * 2.0 ** -24 * np.abs(want[fin]) + 1e-35), err.max()
    np.testing.assert_array_equal(np.isnan(got[~fin]), np.isnan(want[~fin]))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 13, 64, 65, 130])
@pytest.mark.parametrize("k,i", [(576, 1536), (37, 64), (100, 192), (64, 320)])
def test_matches_the_unfused_product(m, k, i):
    rng = np.random.default_rng(m * 1009 + k * 7 + i)
    w = (rng.standard_normal((k, 2 * i)) * 0.3).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    panels = to_dense_panels(jnp.asarray(w))
    full = np.asarray(_mm(jnp.asarray(x), panels, 2 * i))
    got = np.asarray(_gated(jnp.asarray(x), panels, 2 * i, None))
    assert got.shape == (m, i) and got.dtype == np.float32
    _check(got, full[:, :i], full[:, i:])


def test_gates_on_the_tails_and_special_values():
    """One row, K = 1: each gate is x * w exactly. Large negative gates give silu's limit
    (-0), not g * e^-88; -inf gives NaN (as XLA's silu); NaN stays NaN."""
    gates = np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0, 20.0, -20.0, 87.5, -87.5,
                      88.5, -88.5, 100.0, -100.0, 1e30, -1e30, np.inf, -np.inf, np.nan] +
                     list(np.linspace(-30, 30, 43)), np.float32)
    i = 64
    g = np.resize(gates, i).astype(np.float32)
    u = np.linspace(-2, 3, i).astype(np.float32)
    w = np.concatenate([g, u])[None, :]
    panels = to_dense_panels(jnp.asarray(w))
    got = np.asarray(_gated(jnp.ones((1, 1), jnp.float32), panels, 2 * i, None))[0]
    _check(got, g, u)
    for at in np.flatnonzero(g < -88):
        assert got[at] == 0.0 or (np.isinf(g[at]) and np.isnan(got[at]))
    assert np.isnan(got[np.flatnonzero(np.isnan(g))]).all()
    assert np.isnan(got[np.flatnonzero(g == -np.inf)]).all()
    assert np.all(got[g == np.inf] == np.inf * np.sign(u[g == np.inf]))


@pytest.mark.parametrize("live", [0, 1, 5, 64, 65, 130, 200, -3])
def test_live_rows_and_poisoned_padding(live):
    """The first `live` rows are what the whole batch gives them; later rows are zeros even
    when their inputs are NaN and the output buffer held something before."""
    rng = np.random.default_rng(21)
    k, i, m = 96, 128, 130
    panels = to_dense_panels(jnp.asarray(rng.standard_normal((k, 2 * i)), jnp.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    whole = np.asarray(_gated(jnp.asarray(x), panels, 2 * i, None))
    x[max(live, 0):] = np.nan
    n = min(max(live, 0), m)
    for _ in range(2):
        got = np.asarray(_gated(jnp.asarray(x), panels, 2 * i, jnp.int32(live)))
        np.testing.assert_array_equal(got[:n], whole[:n])
        np.testing.assert_array_equal(got[n:], 0.0)


def test_packed_matmul_routes_silu_mul():
    """Panels take the epilogue; packed codes compute the product and XLA's silu; leading
    axes flatten and come back."""
    rng = np.random.default_rng(22)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    panels = to_dense_panels(jnp.asarray(w))
    got = np.asarray(cpu_native.packed_matmul_cpu(x, {"panels": panels}, 256, silu_mul=True))
    full = np.asarray(_mm(x, panels, 256))
    assert got.shape == (2, 3, 128)
    _check(got, full[..., :128], full[..., 128:])
    assert cpu_native.packed_matmul_cpu.silu_mul


def test_bad_arguments_are_refused():
    panels = to_dense_panels(jnp.ones((64, 192), jnp.float32))
    with pytest.raises(ValueError, match="silu_mul"):  # 192 is not a multiple of 128
        cpu_native.dense_matmul_cpu(jnp.ones((1, 64), jnp.float32), panels, 192, silu_mul=True)
    panels = to_dense_panels(jnp.ones((64, 256), jnp.float32))
    with pytest.raises(ValueError, match="silu_mul"):  # 4 panels are not 2 x 128 / 64
        cpu_native.dense_matmul_cpu(jnp.ones((1, 64), jnp.float32), panels, 128, silu_mul=True)
    with pytest.raises(Exception, match="gate and up panels"):  # K mismatch, in the kernel
        cpu_native.dense_matmul_cpu(jnp.ones((1, 48), jnp.float32), panels, 256, silu_mul=True)
