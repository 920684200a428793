"""Greedy tokens through the bfloat16-screened LM head (`pallas_kernels/csrc/lm_head_greedy_cpu.cc`)
against the first argmax of the float32 logits the panel matmul gives (`dense_matmul_cpu`, the
engine's LM head on CPU) and against float64 numpy: exact ties (duplicated columns), near ties
below the screen's resolution, rows that are not screened (NaN, infinite, huge, zero), odd
hidden sizes, vocabularies that end mid-panel, row counts around the 6-row register block;
hypothesis for random shapes; the candidate bound checked directly; bad arguments refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.qlinear import to_dense_panels
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """An XLA:CPU custom call: on a GPU host every case runs on the CPU device."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _head(w: np.ndarray):
    """float32 panels and the screen of ``w [K, N]``."""
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    screen = cpu_native.lm_head_screen(panels, w.shape[1])
    assert screen is not None
    return panels, screen


@jax.jit
def _tokens(x, bf16, norms, panels):
    return cpu_native.lm_head_greedy_cpu(x, {"bf16": bf16, "norms": norms}, panels)


def _want(x: np.ndarray, panels: np.ndarray, n: int) -> np.ndarray:
    """First argmax (NaN counts as the maximum) of the float32 logits `dense_matmul_cpu` gives."""
    logits = np.asarray(jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(panels), n))
    out = []
    for row in logits:
        nan = np.flatnonzero(np.isnan(row))
        out.append(nan[0] if len(nan) else int(np.argmax(row)))
    return np.asarray(out, np.int32)


def _run(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    panels, screen = _head(w)
    got = np.asarray(_tokens(jnp.asarray(x), screen["bf16"], screen["norms"], panels))
    return got, _want(x, panels, w.shape[1])


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(576, 1000), (63, 64), (64, 65), (129, 777)])
def test_random_rows_match_the_float32_argmax(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    x = rng.standard_normal((m, k), dtype=np.float32) * 3
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)
    # And against float64: the token's logit is within float32 rounding of the row's maximum.
    exact = x.astype(np.float64) @ w.astype(np.float64)
    top = exact.max(axis=1)
    assert np.all(exact[np.arange(m), got] >= top - 1e-4 * np.abs(top).clip(1))


def test_exact_ties_go_to_the_lowest_index():
    """Duplicated columns tie exactly in float32: the first one wins, whichever item or thread
    screened it."""
    rng = np.random.default_rng(1)
    k, n = 96, 4096
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.1
    x = rng.standard_normal((9, k), dtype=np.float32)
    best = np.argmax(x @ w, axis=1)
    for r, b in enumerate(best):  # copies of each row's winner, earlier and later
        for at in (3 + r, n - 1 - r, 2048 + r):
            w[:, at] = w[:, b]
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)
    assert np.all(got <= best)


def test_near_ties_below_the_screens_resolution():
    """Columns that differ from the winner by a few float32 ulps: bfloat16 cannot tell them
    apart, the float32 recomputation must."""
    rng = np.random.default_rng(2)
    k, n, m = 576, 3000, 12
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    x = rng.standard_normal((m, k), dtype=np.float32)
    best = np.argmax(x @ w, axis=1)
    for r, b in enumerate(best):
        for j, at in enumerate((10 + r, 1500 + r, n - 1 - r)):
            col = w[:, b].copy()
            col[j] = np.nextafter(col[j], np.float32(np.inf) * np.sign(x[r, j]) * (-1) ** j)
            w[:, at] = col
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)


def test_rows_that_are_not_screened():
    """NaN and infinite hidden states, a norm past the screen's limit and an all-zero row are
    computed in full: the same tokens as the float32 argmax (NaN first)."""
    rng = np.random.default_rng(3)
    k, n = 70, 300
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((6, k), dtype=np.float32)
    x[0, 5] = np.nan
    x[1, 3] = np.inf
    x[2] *= 1e21
    x[3] = 0
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)
    assert got[3] == 0  # all logits 0: the first index


def test_thousands_of_candidates_a_row():
    """Rows where thousands of columns stay candidates (a zero hidden state, a head of equal
    columns, a near-flat head) grow and prune their lists past the kernel's first limit and
    still give the float32 argmax."""
    rng = np.random.default_rng(6)
    k, n = 8, 20000
    w = np.repeat(rng.standard_normal((k, 1), dtype=np.float32), n, axis=1)
    w[:, 7777] *= 1.5  # one column stands out for rows that point along the others
    w[:, 12345:] += rng.standard_normal((k, n - 12345), dtype=np.float32) * 1e-6
    x = rng.standard_normal((5, k), dtype=np.float32)
    x[1] = 0
    x[2] = -x[0]
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)
    assert got[1] == 0


def test_a_head_that_is_not_finite_is_not_screened():
    w = np.ones((8, 64), np.float32)
    w[2, 7] = np.inf
    assert cpu_native.lm_head_screen(np.asarray(to_dense_panels(jnp.asarray(w))), 64) is None
    w[2, 7] = 3.4e38  # finite in float32, infinite in bfloat16
    assert cpu_native.lm_head_screen(np.asarray(to_dense_panels(jnp.asarray(w))), 64) is None


def test_screen_layout_and_bound():
    """The bfloat16 pairs are the panels' values (k even, k odd) rounded to nearest, the norms
    bound each column's float64 norm from above; and the bound the kernel relies on holds for
    bfloat16 scores computed independently in float64."""
    import ml_dtypes

    rng = np.random.default_rng(4)
    k, n = 33, 130
    w = rng.standard_normal((k, n), dtype=np.float32)
    panels, screen = _head(w)
    pairs = screen["bf16"].view(ml_dtypes.bfloat16).astype(np.float32)
    assert pairs.shape == (3, 17, 64, 2)
    wp = np.pad(w, ((0, 1), (0, 3 * 64 - n)))  # K to even, N to whole panels
    for b in range(3):
        for kp in range(17):
            for s in range(2):
                want = wp[2 * kp + s, 64 * b: 64 * b + 64].astype(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(pairs[b, kp, :, s], want.astype(np.float32))
    norms64 = np.linalg.norm(w.astype(np.float64), axis=0)
    assert np.all(screen["norms"].astype(np.float64) >= norms64)
    assert np.all(screen["norms"].astype(np.float64) <= norms64 * (1 + 2 ** -22))
    x = rng.standard_normal((4, k), dtype=np.float32)
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    s = xb @ wb
    r = np.asarray(jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(panels), n))
    ub, u = 2.0 ** -9, 2.0 ** -24
    gk = k * u / (1 - k * u)
    c = 1.01 * ((2 * ub + ub * ub) + gk * (1 + ub) ** 2 + gk)
    bound = c * np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * norms64[None]
    assert np.all(np.abs(s - r) <= bound)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 200), n=st.integers(1, 700),
       seed=st.integers(0, 2 ** 31), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e15]),
       dup=st.booleans())
def test_random_shapes(m, k, n, seed, scale, dup):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if dup and n > 1:
        w[:, rng.integers(0, n, n // 2)] = w[:, [rng.integers(0, n)]]
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    got, want = _run(x, w)
    np.testing.assert_array_equal(got, want)


def _host_has_amx_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return "amx_bf16" in flags and "amx_tile" in flags


def test_the_screen_uses_amx_where_the_host_has_it():
    """Built with -march=native: AMX-BF16 hosts screen with tiles, others cannot."""
    assert cpu_native.lm_head_amx() == _host_has_amx_bf16()


@pytest.mark.parametrize("m", [3, 4, 15, 16, 17, 64, 100])
@pytest.mark.parametrize("k,n", [(576, 1000), (64, 65), (96, 4096), (129, 777)])
def test_amx_and_vector_screens_pick_the_same_tokens(m, k, n, monkeypatch):
    """The AMX screen (rows padded to 16, k in tiles of 32; hidden sizes that are not take the
    vector screen, as do fewer than 4 rows) against `vdpbf16ps` and the float32 argmax, with an
    exact tie (a duplicated column) and a zero row. On hosts without AMX both runs take the
    vector screen."""
    rng = np.random.default_rng(m * 7 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    w[:, n // 2] = w[:, n // 3]  # an exact tie: the lower index wins
    x = rng.standard_normal((m, k), dtype=np.float32) * 3
    x[0] = 0.0  # every score 0: all columns tie
    panels, screen = _head(w)
    want = _want(x, panels, n)
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDJAX_LM_HEAD_AMX", flag)
        got[flag] = np.asarray(_tokens(jnp.asarray(x), screen["bf16"], screen["norms"], panels))
    np.testing.assert_array_equal(got["1"], want)
    np.testing.assert_array_equal(got["0"], want)
    assert got["1"][0] == 0


def test_bad_arguments_are_refused():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 64), dtype=np.float32)
    panels, screen = _head(w)
    with pytest.raises(Exception, match="float32 panels"):
        _tokens(jnp.zeros((2, 8), jnp.float32), screen["bf16"], screen["norms"], panels)
    with pytest.raises(TypeError, match="float32 \\[M, K\\]"):
        cpu_native.lm_head_greedy_cpu(jnp.zeros((2, 16), jnp.bfloat16), screen, panels)
