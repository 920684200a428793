"""The native one-pass greedy sampler (`pallas_kernels/csrc/greedy_rows_cpu.cc`) against float64
numpy and against `sample_greedy`'s XLA path: first-maximum tokens exactly (ties, NaN rows,
infinities, widths around its 16-lane vectors and 64-value sums, row counts around its
two-row work items and the helper threshold), raw logprobs to float rounding; random rows
from hypothesis; bad arguments refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pagedjax.sampler import sample_greedy
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")

_greedy = jax.jit(cpu_native.greedy_rows_cpu)


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The kernel is an XLA:CPU custom call: on a GPU host the default device is the GPU, which
    has no handler for it (the fourth GPU run's 56 failures), so every case runs on the CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _want(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's first argmax (a NaN counts as the maximum, as in `first_argmax`) and the
    float64 logprob -log(sum(exp(x - max))) (NaN where the max is NaN or infinite), of the
    row as XLA:CPU's threads see it: they run with subnormals read as zero (denormals-are-zero),
    so [-1e-45, 0] is a tie whose first index wins, in `jnp.argmax`, `first_argmax` and the
    native kernel alike (hypothesis found that row in CI)."""
    x = np.where((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny), np.float32(0), x)
    x64 = x.astype(np.float64)
    tok = np.argmax(x64, axis=-1)  # the first NaN if any, else the first maximum
    top = np.take_along_axis(x64, tok[:, None], -1)
    with np.errstate(invalid="ignore", over="ignore"):
        lp = -np.log(np.exp(x64 - top).sum(-1))
    return tok, lp


def _check(x: np.ndarray) -> None:
    tok, lp = (np.asarray(a) for a in _greedy(jnp.asarray(x)))
    want_tok, want_lp = _want(x)
    np.testing.assert_array_equal(tok, want_tok)
    assert tok.dtype == np.int32 and lp.dtype == np.float32
    nan = np.isnan(want_lp)
    np.testing.assert_array_equal(np.isnan(lp), nan)
    # Float exps summed in 64-value blocks, in double across them: ~1e-7 relative.
    np.testing.assert_allclose(lp[~nan], want_lp[~nan], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 64, 257])
@pytest.mark.parametrize("v", [1, 15, 16, 17, 63, 64, 65, 129, 1000, 49152])
def test_matches_float64(b, v):
    rng = np.random.default_rng(b * 100_000 + v)
    x = (rng.standard_normal((b, v)) * 6).astype(np.float32)
    if v > 1:
        x[0, [v - 1, v // 2]] = x[0].max() + 1  # a tie: the lower index wins
        x[b - 1, v - 1] = x[b - 1].max() + 0.5  # the maximum in the last (partial) vector
    _check(x)


def test_special_rows():
    """NaN (first NaN wins), +inf, all -inf, -inf around a finite max, values far below the
    max (their exp underflows to 0), subnormals, constant rows and huge magnitudes."""
    v = 200
    x = np.zeros((10, v), np.float32)
    x[0, [33, 7, 150]] = np.nan
    x[1, 90] = np.inf
    x[2] = -np.inf
    x[3] = -np.inf
    x[3, 120] = 2.5
    x[4] = -1e30
    x[4, 5] = 0.0
    x[5] = np.float32(1e-42)  # subnormal, all equal: index 0
    x[6] = 7.0
    x[7, :] = np.linspace(-200, 0, v, dtype=np.float32)  # exp(-200) is below float's range
    x[8] = 3e38
    x[8, 199] = np.inf
    x[9, 199] = np.nan
    x[5, 3] = np.float32(-1e-45)  # read as zero: still a tie with the rest, index 0 wins
    tok, lp = (np.asarray(a) for a in _greedy(jnp.asarray(x)))
    assert list(tok) == [7, 90, 0, 120, 5, 0, 0, v - 1, 199, 199]
    assert np.isnan(lp[[0, 1, 2, 8, 9]]).all()
    np.testing.assert_allclose(lp[[3, 4]], 0.0, atol=0)
    np.testing.assert_allclose(lp[[5, 6]], -np.log(v), rtol=1e-6)
    _check(x)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 300)),
              elements=st.floats(-1e4, 1e4, width=32, allow_nan=False)))
def test_random_rows(x):
    _check(x)


def test_subnormals_read_as_zero_like_xla():
    """The row hypothesis found: a negative subnormal before a zero. XLA:CPU's own argmax reads
    the subnormal as zero too, so the native kernel and the XLA sampler agree (index 0)."""
    x = jnp.asarray(np.array([[-1e-45, 0.0], [0.0, 1e-45], [-1e-40, 3e-41], [1e-45, -1.0]],
                             np.float32))
    tok = np.asarray(_greedy(x)[0])
    np.testing.assert_array_equal(tok, np.asarray(jax.jit(lambda a: jnp.argmax(a, -1))(x)))
    np.testing.assert_array_equal(tok, [0, 0, 0, 0])
    _check(np.asarray(x))


@pytest.mark.parametrize("b", [1, 7, 64])
def test_sample_greedy_native_equals_xla(b):
    """`sample_greedy(native=True)`, what the CPU engine runs, against its XLA path: the same
    tokens (rows repeated, as an n > 1 fan-out picks them), logprobs to float rounding."""
    rng = np.random.default_rng(b)
    logits = jnp.asarray((rng.standard_normal((b, 4099)) * 5).astype(np.float32))
    rows = jnp.asarray(rng.integers(0, b, 2 * b + 1), jnp.int32)
    got = sample_greedy(logits, rows, num_logprobs=3, native=True)
    ref = sample_greedy(logits, rows, num_logprobs=3, native=False)
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(ref.token_ids))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), rtol=1e-6,
                               atol=1e-6)
    for a, r in zip(got[2:5], ref[2:5]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    bf16 = logits.astype(jnp.bfloat16)  # a bf16 model's logits go in widened
    np.testing.assert_array_equal(
        np.asarray(sample_greedy(bf16, rows, native=True).token_ids),
        np.asarray(sample_greedy(bf16, rows, native=False).token_ids))


def test_bad_arguments_refused():
    with pytest.raises(TypeError, match="float32"):
        cpu_native.greedy_rows_cpu(jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"\[B, V\]"):
        cpu_native.greedy_rows_cpu(jnp.zeros((8,), jnp.float32))
    with pytest.raises(Exception, match="at least one column"):
        jax.block_until_ready(_greedy(jnp.zeros((2, 0), jnp.float32)))
    tok, lp = _greedy(jnp.zeros((0, 8), jnp.float32))
    assert tok.shape == (0,) and lp.shape == (0,)
