"""Greedy tokens through the screened LM head (`pallas_kernels/csrc/lm_head_greedy_cpu.cc`),
its bfloat16 screen and (on AVX512-VNNI hosts) its 8-bit one, against the first argmax of the
float32 logits the panel matmul gives (`dense_matmul_cpu`, the engine's LM head on CPU) and
against float64 numpy: exact ties (duplicated columns), near ties below the screen's
resolution, rows that are not screened (NaN, infinite, huge, zero), odd hidden sizes,
vocabularies that end mid-panel, row counts around the 6-row register block; hypothesis for
random shapes; both candidate bounds checked directly; rows whose few large dimensions the
8-bit screen takes in float32; bad arguments refused."""

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


def _has_int8() -> bool:
    return cpu_native.available() and "avx512vnni" in cpu_native.compiled_isa()


KINDS = ["bf16", pytest.param("int8", marks=pytest.mark.skipif(
    not _has_int8(), reason="the 8-bit screen needs an AVX512-VNNI host"))]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _head(w: np.ndarray, kind: str = "bf16"):
    """float32 panels and the screen of ``w [K, N]``."""
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    screen = cpu_native.lm_head_screen(panels, w.shape[1], kind)
    assert screen is not None and kind in screen
    return panels, screen


@jax.jit
def _tokens(x, screen, panels):
    return cpu_native.lm_head_greedy_cpu(x, screen, panels)


def _want(x: np.ndarray, panels: np.ndarray, n: int) -> np.ndarray:
    """First argmax (NaN counts as the maximum) of the float32 logits `dense_matmul_cpu` gives."""
    logits = np.asarray(jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(panels), n))
    out = []
    for row in logits:
        nan = np.flatnonzero(np.isnan(row))
        out.append(nan[0] if len(nan) else int(np.argmax(row)))
    return np.asarray(out, np.int32)


def _run(x: np.ndarray, w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    panels, screen = _head(w, kind)
    got = np.asarray(_tokens(jnp.asarray(x), screen, panels))
    return got, _want(x, panels, w.shape[1])


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(576, 1000), (63, 64), (64, 65), (129, 777)])
def test_random_rows_match_the_float32_argmax(m, k, n, kind):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    x = rng.standard_normal((m, k), dtype=np.float32) * 3
    got, want = _run(x, w, kind)
    np.testing.assert_array_equal(got, want)
    # And against float64: the token's logit is within float32 rounding of the row's maximum.
    exact = x.astype(np.float64) @ w.astype(np.float64)
    top = exact.max(axis=1)
    assert np.all(exact[np.arange(m), got] >= top - 1e-4 * np.abs(top).clip(1))


def test_exact_ties_go_to_the_lowest_index(kind):
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
    got, want = _run(x, w, kind)
    np.testing.assert_array_equal(got, want)
    assert np.all(got <= best)


def test_near_ties_below_the_screens_resolution(kind):
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
    got, want = _run(x, w, kind)
    np.testing.assert_array_equal(got, want)


def test_rows_that_are_not_screened(kind):
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
    got, want = _run(x, w, kind)
    np.testing.assert_array_equal(got, want)
    assert got[3] == 0  # all logits 0: the first index


def test_thousands_of_candidates_a_row(kind):
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
    got, want = _run(x, w, kind)
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
       dup=st.booleans(), kind=st.sampled_from(["bf16", "int8"] if _has_int8() else ["bf16"]))
def test_random_shapes(m, k, n, seed, scale, dup, kind):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if dup and n > 1:
        w[:, rng.integers(0, n, n // 2)] = w[:, [rng.integers(0, n)]]
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    got, want = _run(x, w, kind)
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
        got[flag] = np.asarray(_tokens(jnp.asarray(x), screen, panels))
    np.testing.assert_array_equal(got["1"], want)
    np.testing.assert_array_equal(got["0"], want)
    assert got["1"][0] == 0


def test_bad_arguments_are_refused(kind):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 64), dtype=np.float32)
    panels, screen = _head(w, kind)
    with pytest.raises(Exception, match="float32 panels"):
        _tokens(jnp.zeros((2, 8), jnp.float32), screen, panels)
    with pytest.raises(TypeError, match="float32 \\[M, K\\]"):
        cpu_native.lm_head_greedy_cpu(jnp.zeros((2, 16), jnp.bfloat16), screen, panels)


def test_the_screen_kind_follows_the_host(monkeypatch):
    """`auto` builds the 8-bit screen on an AVX512-VNNI host without AMX, bfloat16 elsewhere,
    with PAGEDJAX_LM_HEAD_INT8=0 and for a head whose column norms pass 1e15; an unknown kind
    is refused by name."""
    w = np.random.default_rng(7).standard_normal((40, 100)).astype(np.float32)
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    want = "int8" if _has_int8() and not cpu_native.lm_head_amx() else "bf16"
    assert cpu_native.lm_head_screen_kind() == want
    assert want in cpu_native.lm_head_screen(panels, 100)
    monkeypatch.setenv("PAGEDJAX_LM_HEAD_INT8", "0")
    assert cpu_native.lm_head_screen_kind() == "bf16"
    assert "bf16" in cpu_native.lm_head_screen(panels, 100)
    monkeypatch.delenv("PAGEDJAX_LM_HEAD_INT8")
    assert "bf16" in cpu_native.lm_head_screen(panels * np.float32(1e15), 100)
    with pytest.raises(ValueError, match="kind"):
        cpu_native.lm_head_screen(panels, 100, "fp8")


def _int8_reference(w: np.ndarray):
    """Independently: each column's step, codes, error norm and -128 sum of codes."""
    step = np.abs(w).max(axis=0) / np.float32(127)
    q = np.clip(np.rint(w / np.where(step > 0, step, 1)), -127, 127)
    err = np.linalg.norm(w.astype(np.float64) - step.astype(np.float64) * q, axis=0)
    return step, q.astype(np.int64), err, -128 * q.astype(np.int64).sum(axis=0)


def test_int8_screen_layout():
    """Codes [P, ceil(K / 4), 64, 4] are each column's steps (k in fours, zeros past K and
    past N), `qcols` its step and error norm (rounded up), `qbias` -128 times its code sum."""
    rng = np.random.default_rng(8)
    k, n = 33, 130
    w = rng.standard_normal((k, n), dtype=np.float32)
    w[:, 5] = 0.0  # a zero column: step 0, codes 0
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    screen = cpu_native.lm_head_screen(panels, n, "int8")
    step, q, err, bias = _int8_reference(w)
    codes = screen["int8"]
    assert codes.shape == (3, 9, 64, 4) and codes.dtype == np.int8
    full = codes.transpose(0, 1, 3, 2).reshape(3, 36, 64).transpose(1, 0, 2).reshape(36, 192)
    np.testing.assert_array_equal(full[:k, :n], q)
    assert not full[k:].any() and not full[:, n:].any()
    np.testing.assert_array_equal(screen["qcols"][0, :n], step)
    assert np.all(screen["qcols"][1, :n].astype(np.float64) >= err)
    assert np.all(screen["qcols"][1, :n].astype(np.float64) <= err * (1 + 2 ** -22))
    np.testing.assert_array_equal(screen["qbias"][:n], bias)
    assert not screen["qcols"][:, n:].any() and not screen["qbias"][n:].any()


def _block_outliers(x: np.ndarray, n: int = 24, block: int = 6) -> list[np.ndarray]:
    """Each row's set O as the 8-bit screen picks it: per 6-row block, the n dimensions with
    the largest |x_k| / ||x|| over the block's rows (ties: the lower index)."""
    out = []
    for b0 in range(0, len(x), block):
        xb = x[b0:b0 + block].astype(np.float64)
        nrm = np.linalg.norm(xb, axis=1, keepdims=True)
        score = (np.abs(xb) / np.where(nrm > 0, nrm, 1)).max(axis=0)
        o = np.sort(np.argsort(-score, kind="stable")[:n])
        out += [o] * len(xb)
    return out


def test_int8_bound_holds_in_float64():
    """The 8-bit score in float64 (its 6-row block's 24 dimensions O exact, the rest in steps
    of the row's remaining maximum / 127) is within the kernel's bound b_j of the float32
    logit, for rows with a few large dimensions as real hidden states have, some shared by
    every row and some a row's own; and on them the bound keeps a handful of columns, not
    thousands."""
    rng = np.random.default_rng(9)
    k, n, m = 576, 4000, 16
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, 12, replace=False)] *= 15  # outlying dimensions
    for row in range(m):  # and a few of each row's own
        x[row, rng.choice(k, 3, replace=False)] *= 10
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    r = np.asarray(jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(panels), n)).astype(np.float64)
    step, q, _, _ = _int8_reference(w)
    ew = np.linalg.norm(w.astype(np.float64) - step.astype(np.float64) * q, axis=0)
    nw = np.linalg.norm(w.astype(np.float64), axis=0)
    u = 2.0 ** -24
    gk = k * u / (1 - k * u)
    kept = []
    for row, (xr, o) in enumerate(zip(x.astype(np.float64), _block_outliers(x))):
        rest = np.setdiff1d(np.arange(k), o)
        t = np.float32(np.abs(xr[rest]).max()) / np.float32(127)
        xt = np.zeros(k)
        xt[rest] = np.clip(np.rint(xr[rest] / t), -127, 127) * float(t)
        s = (xt @ (step.astype(np.float64) * q)) + xr[o] @ w[o].astype(np.float64)
        ex = np.linalg.norm(xr[rest] - xt[rest])
        b = (1.02 * (ex + (gk + 1024 * u) * np.linalg.norm(xr)) * nw
             + 1.02 * np.linalg.norm(xt) * ew)
        assert np.all(np.abs(s - r[row]) <= b)
        kept.append(int(np.sum(s + b >= np.max(s - b))))
    assert max(kept) < 100, kept


def test_int8_rows_with_large_dimensions(kind):
    """Rows whose largest dimensions dwarf the rest by 10-1000x (more of them than the 24
    a block takes in float32, and different in each row; some negative): the screened token
    is the float32 argmax."""
    rng = np.random.default_rng(10)
    k, n, m = 256, 3000, 13
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    for row in range(m):
        dims = rng.choice(k, 1 + 2 * row, replace=False)
        x[row, dims] *= np.float32(10.0 ** (1 + row % 3)) * rng.choice([-1, 1], len(dims))
    got, want = _run(x, w, kind)
    np.testing.assert_array_equal(got, want)
