"""add_rms_norm (the Pallas kernel; interpreted on CPU, Triton on a GPU) against float64 numpy
and against the model's own `rms_norm` after XLA's add."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import rms_norm
from pallas_kernels.add_rms_norm import add_rms_norm, add_rms_norm_ref

# (leading shape, hidden, dtype, with a delta). Hidden sizes: powers of two (Llama's 4096) and
# not (SmolLM2's 576, a padded row), one row (a batch-1 decode) and several.
CASES = [
    ((1,), 4096, "bfloat16", True),
    ((1,), 4096, "float32", False),
    ((5,), 576, "float32", True),
    ((2, 3), 576, "bfloat16", False),
    ((64,), 128, "float16", True),
    ((3,), 96, "float32", True),
    ((17,), 1024, "bfloat16", True),
]
TOL = {"float32": 2e-6, "bfloat16": 1.6e-2, "float16": 2e-3}


def _inputs(lead, hidden, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, hidden)) * rng.uniform(0.1, 30)).astype(np.float32)
    d = rng.standard_normal((*lead, hidden)).astype(np.float32)
    w = rng.uniform(-2, 2, hidden).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(d, dtype), jnp.asarray(w, dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{'add' if c[3] else 'norm'}")
def test_matches_float64_numpy(case):
    lead, hidden, dtype, with_delta = case
    x, d, w = _inputs(lead, hidden, dtype, seed=hidden + len(lead))
    eps = 1e-5
    r, h = add_rms_norm(x, d if with_delta else None, w, eps)
    assert r.shape == h.shape == x.shape and r.dtype == h.dtype == x.dtype
    # The residual is the add rounded to the activations' dtype, exactly as XLA rounds it.
    want_r = x + d if with_delta else x
    np.testing.assert_array_equal(np.asarray(r, np.float64), np.asarray(want_r, np.float64))
    rf = np.asarray(want_r, np.float64)
    want = rf / np.sqrt((rf * rf).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)
    got = np.asarray(h, np.float64)
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= TOL[dtype], err
    # And the model's own norm (what the XLA path computes) within the dtype's rounding.
    model = np.asarray(rms_norm(want_r, w, eps), np.float64)
    assert np.abs(got - model).max() / max(1.0, np.abs(model).max()) <= TOL[dtype]


def test_reference_equals_the_model_norm_after_the_add():
    x, d, w = _inputs((4,), 576, "float32", seed=3)
    r, h = add_rms_norm_ref(x, d, w, 1e-6)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(x + d))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(rms_norm(x + d, w, 1e-6)))


def test_rows_are_independent():
    """A row's output depends on that row only: changing another row (a padding token's
    garbage, say, to huge values) leaves it bit for bit."""
    x, d, w = _inputs((6,), 576, "float32", seed=5)
    r1, h1 = add_rms_norm(x, d, w, 1e-5)
    x2 = x.at[3].set(1e30).at[5].set(jnp.nan)
    r2, h2 = add_rms_norm(x2, d, w, 1e-5)
    keep = [0, 1, 2, 4]
    np.testing.assert_array_equal(np.asarray(h1)[keep], np.asarray(h2)[keep])
    np.testing.assert_array_equal(np.asarray(r1)[keep], np.asarray(r2)[keep])


def test_bad_shapes_name_the_argument():
    x, d, w = _inputs((2,), 64, "float32", seed=0)
    with pytest.raises(ValueError, match="weight shape"):
        add_rms_norm(x, d, w[:32], 1e-5)
    with pytest.raises(ValueError, match="delta shape"):
        add_rms_norm(x, d[:1], w, 1e-5)
