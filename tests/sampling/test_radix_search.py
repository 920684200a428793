"""The exact threshold search several bits per pass (`sampler._smallest_key`, radix_bits > 0,
opt-in for GPU runners through ``PAGEDJAX_SEARCH_RADIX_BITS``): the same key as bisection for
any monotone predicate, and the same kept tokens as float64 numpy when rows need the search."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

import pagedjax.chunked_top_k as ctk
import pagedjax.sampler as sampler_mod
from pagedjax.sampler import _from_order_key, _order_key, _smallest_key, filter_logits
from tests.sampling.test_sampler import np_keep_mask

I32 = np.iinfo(np.int32)


def _search(targets: np.ndarray, bits: int) -> np.ndarray:
    t = jnp.asarray(targets, jnp.int32)
    f = jax.jit(lambda t: _smallest_key(lambda m: m >= t, t.shape[0], bits))
    return np.asarray(f(t))


@pytest.mark.parametrize("bits", [0, 1, 2, 4, 8])
def test_every_radix_finds_the_threshold_at_the_range_ends(bits):
    targets = np.array([I32.min, I32.min + 1, -1, 0, 1, I32.max - 1, I32.max, 12345,
                        -(1 << 28), (1 << 28) - 1], np.int64).astype(np.int32)
    np.testing.assert_array_equal(_search(targets, bits), targets)


@settings(max_examples=20, deadline=None)
@given(st_.lists(st_.integers(I32.min, I32.max), min_size=1, max_size=8),
       st_.sampled_from([1, 2, 4, 8]))
def test_radix_search_equals_bisection(targets, bits):
    t = np.array(targets, np.int64).astype(np.int32)
    np.testing.assert_array_equal(_search(t, bits), _search(t, 0))
    np.testing.assert_array_equal(_search(t, bits), t)


def test_mass_search_equals_bisection_on_float_keys():
    """The top-p predicate over real rows (mass above a key): every radix returns the key
    bisection returns."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(6, 777)).astype(np.float32))
    p = jnp.asarray([0.1, 0.5, 0.9, 0.95, 0.999, 1.0], jnp.float32)
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    tot = e.sum(axis=-1)
    key = _order_key(x)

    def thr(bits):
        return np.asarray(jax.jit(lambda: _from_order_key(_smallest_key(
            lambda m: jnp.sum(jnp.where(key > m[:, None], e, 0.0), axis=-1) < p * tot,
            6, bits)))())

    want = thr(0)
    for bits in (2, 4, 8):
        np.testing.assert_array_equal(thr(bits), want)


def test_flat_rows_through_the_radix_search_match_numpy(monkeypatch):
    """Flat rows whose nucleus is far past the candidates, with top-k past them too: the
    chunked (GPU) filter with 4 bits per pass keeps what float64 numpy keeps."""
    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    monkeypatch.setattr(sampler_mod, "SEARCH_RADIX_BITS", 4)
    rng = np.random.default_rng(21)
    b, v = 8, 2048
    x = (rng.normal(size=(b, v)) * 0.3).astype(np.float32)
    top_k = np.array([v, 600, v, 300, v, 1500, v, 200], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.8, 0.99, 0.95, 0.7, 1.0], np.float32)
    min_p = np.zeros(b, np.float32)
    args = (jnp.asarray(x), top_k, top_p, min_p)
    radixes = []
    real = sampler_mod._smallest_key

    def spy(pred, rows, radix_bits=0):
        radixes.append(radix_bits)
        return real(pred, rows, radix_bits)

    monkeypatch.setattr(sampler_mod, "_smallest_key", spy)
    got = np.isfinite(np.asarray(jax.jit(lambda *a: filter_logits(*a, chunked=True))(*args)))
    assert radixes and set(radixes) == {4}
    want, ambiguous = np_keep_mask(x, top_k, top_p, min_p)
    assert (want.sum(axis=1) > 128).all()  # every nucleus past the candidates
    # Rows whose cut lands within 1e-4 of a token's mass may round either way in float32.
    assert (~ambiguous).sum() >= 5
    np.testing.assert_array_equal(got[~ambiguous], want[~ambiguous])


@pytest.mark.parametrize("raw", ["3", "16", "x", "-4"])
def test_a_bad_radix_setting_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDJAX_SEARCH_RADIX_BITS", raw)
    with pytest.raises(ValueError, match="PAGEDJAX_SEARCH_RADIX_BITS"):
        sampler_mod._radix_from_env()


def test_gpu_runners_search_two_bits_a_pass_by_default(monkeypatch):
    """The seventh GPU run's verdict (docs/gpu.md): 2 bits unless the variable says otherwise."""
    monkeypatch.delenv("PAGEDJAX_SEARCH_RADIX_BITS", raising=False)
    assert sampler_mod._radix_from_env() == 2
    monkeypatch.setenv("PAGEDJAX_SEARCH_RADIX_BITS", "0")
    assert sampler_mod._radix_from_env() == 0
