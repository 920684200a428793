"""`chunked_top_k` and the sampler's ``chunked`` mode (GPUs' two-stage top-k) against numpy
and the one-stage sampler: random rows, ties, ``-inf`` rows, and rows whose top values crowd
one chunk, where the first stage leaves some out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

import pagedjax.chunked_top_k as ctk
from pagedjax.chunked_top_k import PER_CHUNK, chunked_top_k, exact_top_k
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, filter_logits, prompt_logprobs, sample
from pagedjax.sampling_params import SamplingParams


def _chunk_ids(v: int, chunk: int, j: int, n: int) -> np.ndarray:
    """The first ``n`` token ids of (strided) chunk ``j``: j, j + C, j + 2C, ..."""
    c = -(-v // chunk)
    ids = j + c * np.arange(n)
    return ids[ids < v]


def _rows(rng: np.random.Generator, b: int, v: int, chunk: int, kind: str) -> np.ndarray:
    x = rng.normal(size=(b, v)).astype(np.float32) * 3
    if kind == "ties":
        x = np.round(x, 0)
    elif kind == "crowded":  # each row's 60 largest values in one chunk
        for i in range(b):
            ids = _chunk_ids(v, chunk, int(rng.integers(-(-v // chunk))), 60)
            x[i, ids] = 20 + rng.normal(size=len(ids))
    elif kind == "contiguous":  # 60 large values in consecutive ids (spread over chunks)
        for i in range(b):
            lo = int(rng.integers(v - 60))
            x[i, lo:lo + 60] = 20 + rng.normal(size=60)
    elif kind == "banned":  # all but a few tokens at -inf, as a structured-output mask leaves
        keep = rng.random((b, v)) < 0.002
        keep[:, 0] = True
        x = np.where(keep, x, -np.inf).astype(np.float32)
    return x


def _check_chunked(x: np.ndarray, k: int, chunk: int) -> None:
    vals, ids, hidden = (np.asarray(a) for a in jax.jit(
        chunked_top_k, static_argnums=(1, 2))(jnp.asarray(x), k, chunk))
    b, v = x.shape
    assert vals.shape == ids.shape == (b, k) and hidden.shape == (b,)
    want = -np.sort(-x.astype(np.float64), axis=-1)[:, :k]
    c = -(-v // chunk)
    two_stage = k > PER_CHUNK and c > 1 and v // c >= PER_CHUNK and c * PER_CHUNK >= k
    for i in range(b):
        assert len(set(ids[i].tolist())) == k and ((0 <= ids[i]) & (ids[i] < v)).all()
        np.testing.assert_array_equal(x[i, ids[i]], vals[i])  # each value is its id's
        assert (vals[i][:-1] >= vals[i][1:]).all()
        exact = vals[i] > hidden[i]  # the claim: exact wherever above `hidden`
        np.testing.assert_array_equal(vals[i][exact], want[i][exact])
        # ... and nothing above `hidden` is missing.
        assert exact.sum() == min((x[i] > hidden[i]).sum(), k)
        if two_stage:  # `hidden` is the largest 16th value of a chunk
            padded = np.pad(x[i], (0, c * chunk - v), constant_values=-np.inf)
            strided = padded.reshape(chunk, c).T  # row j: tokens j, j + c, ...
            assert hidden[i] == np.sort(strided, axis=-1)[:, -PER_CHUNK].max()
        else:
            assert hidden[i] == -np.inf


@pytest.mark.parametrize("kind", ["normal", "ties", "crowded", "contiguous", "banned"])
@pytest.mark.parametrize("v,chunk,k", [(4096, 256, 128), (5000, 256, 20), (1000, 64, 128),
                                       (777, 32, 64), (4096, 256, 16), (300, 512, 128)])
def test_chunked_top_k_is_exact_above_hidden(kind, v, chunk, k):
    _check_chunked(_rows(np.random.default_rng(v + k), 6, v, chunk, kind), k, chunk)


@settings(max_examples=40, deadline=None)
@given(b=st_.integers(1, 4), v=st_.integers(17, 700), chunk=st_.sampled_from([17, 32, 100]),
       k=st_.integers(1, 80), decimals=st_.sampled_from([None, 0]), seed=st_.integers(0, 2**31))
def test_chunked_top_k_property(b, v, chunk, k, decimals, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, v)).astype(np.float32)
    if decimals is not None:
        x = np.round(x, decimals).astype(np.float32)
    _check_chunked(x, min(k, v), chunk)


@pytest.mark.parametrize("kind", ["normal", "ties", "crowded", "contiguous", "banned"])
def test_exact_top_k_equals_lax_top_k(kind):
    """Values always equal `lax.top_k`'s (the crowded rows take the fallback); ids too,
    ties included (lowest id first), except among -inf values."""
    x = _rows(np.random.default_rng(3), 8, 3000, 128, kind)
    got_v, got_i = (np.asarray(a) for a in jax.jit(exact_top_k, static_argnums=(1, 2))(
        jnp.asarray(x), 20, 128))
    want_v, want_i = (np.asarray(a) for a in jax.lax.top_k(jnp.asarray(x), 20))
    np.testing.assert_array_equal(got_v, want_v)
    if kind != "banned":
        np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(np.take_along_axis(x, got_i, -1), got_v)


def _case_rows(rng, b: int, v: int, kind: str, peak: float) -> np.ndarray:
    """Rows for the sampler comparisons: "crowded", "normal", or "peaked" (normal times
    ``peak``), chunks of 64."""
    x = _rows(rng, b, v, 64, "crowded" if kind == "crowded" else "normal")
    return x * peak if kind == "peaked" else x


def _meta(params, vocab):
    states = [SeqSamplingState([1, 2, 3], [4, 5], i, 0) for i in range(len(params))]
    return SamplingMetadata.from_params(list(zip(params, states)), len(params), vocab)


@pytest.mark.parametrize("kind", ["normal", "crowded", "peaked"])
def test_filter_thresholds_chunked_match_one_stage(monkeypatch, kind):
    """The kept set of top-k / top-p / min-p is the same from chunked candidates as from
    `lax.top_k`'s (both exact: where the chunked ones do not decide a row, it searches)."""
    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    rng = np.random.default_rng(11)
    b, v = 24, 2048
    x = _case_rows(rng, b, v, kind, peak=4)
    top_k = rng.choice([v, 10, 50, 128, 200, 1], size=b).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.99], size=b).astype(np.float32)
    min_p = rng.choice([0.0, 0.05], size=b).astype(np.float32)
    args = (jnp.asarray(x), top_k, top_p, min_p)
    one = np.asarray(filter_logits(*args))
    two = np.asarray(jax.jit(lambda *a: filter_logits(*a, chunked=True))(*args))
    np.testing.assert_array_equal(np.isfinite(two), np.isfinite(one))


@pytest.mark.parametrize("kind", ["normal", "crowded", "peaked"])
def test_sample_chunked_gives_the_same_tokens_and_logprobs(monkeypatch, kind):
    """`sample(chunked=True)`: the same tokens seed by seed and the same top-20 logprobs as
    the one-stage sampler, with rows drawn from the candidates, rows that search, and rows
    whose candidates crowd one chunk (the candidate draw must not take a token left out)."""
    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    rng = np.random.default_rng(12)
    b, v = 16, 2048
    x = _case_rows(rng, b, v, kind, peak=3)
    params = [SamplingParams(temperature=float(rng.uniform(0.5, 1.2)),
                             top_p=[0.9, 1.0, 0.6][i % 3], top_k=[-1, 20, 100][i % 3 - 1],
                             min_p=[0.0, 0.02][i % 2], seed=i, logprobs=20)
              for i in range(b)]
    meta = _meta(params, v)
    for s in range(12):
        m = meta.replace(seed=meta.seed + s)
        one = sample(jnp.asarray(x), m, num_logprobs=20)
        two = sample(jnp.asarray(x), m, num_logprobs=20, chunked=True)
        np.testing.assert_array_equal(np.asarray(two.token_ids), np.asarray(one.token_ids))
        np.testing.assert_array_equal(np.asarray(two.topk_logprobs), np.asarray(one.topk_logprobs))
        np.testing.assert_array_equal(np.asarray(two.topk_ids), np.asarray(one.topk_ids))
        np.testing.assert_array_equal(np.asarray(two.logprobs), np.asarray(one.logprobs))


def test_prompt_logprobs_chunked_match(monkeypatch):
    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    x = _rows(np.random.default_rng(13), 10, 2048, 64, "crowded")
    nxt = np.arange(10, dtype=np.int32)
    one = prompt_logprobs(jnp.asarray(x), nxt, 20)
    two = prompt_logprobs(jnp.asarray(x), nxt, 20, chunked=True)
    for a, b_ in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.parametrize("chunked", [False, True])
def test_candidates_decide_confident_rows_without_the_search(monkeypatch, chunked):
    """Peaked rows with top-k within the candidates (alone and with top-p / min-p) and top-p
    alone take their thresholds from the candidates: with the exact search broken, the kept
    sets still match float64 numpy. (Until stop 53 a top-k row always searched: the test of
    the k-th value against the last candidate was inverted.)"""
    import pagedjax.sampler as sampler_mod
    from tests.sampling.test_sampler import np_keep_mask

    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    monkeypatch.setattr(sampler_mod, "_smallest_key",
                        lambda pred, rows, radix_bits=0: jnp.full((rows,), jnp.iinfo(jnp.int32).max))
    rng = np.random.default_rng(14)
    b, v = 16, 2048
    x = (rng.normal(size=(b, v)) * 6).astype(np.float32)
    top_k = np.array([50, 20, 100, v] * 4, np.int32)
    top_p = np.array([1.0, 0.9, 0.95, 0.8] * 4, np.float32)
    min_p = np.array([0.0] * 8 + [0.01] * 8, np.float32)
    got = np.isfinite(np.asarray(jax.jit(lambda *a: filter_logits(*a, chunked=chunked))(
        jnp.asarray(x), top_k, top_p, min_p)))
    want, ambiguous = np_keep_mask(x, top_k, top_p, min_p)
    assert not ambiguous.any()
    np.testing.assert_array_equal(got, want)


def test_a_nucleus_past_the_exact_candidates_is_searched(monkeypatch):
    """Chunk 0 holds 20 near-equal top values (the first stage keeps 16: `hidden` is the
    16th) and chunk 5 ten a little lower. The candidates (16 + 10 + ...) hold top_p = 0.75 of
    the mass, but only the 15 above `hidden` are exact, and the true cut lies past them: the
    row must take the search, not cut among candidates that miss four of chunk 0's values
    (which would keep 27 tokens instead of 22)."""
    from tests.sampling.test_sampler import np_keep_mask

    monkeypatch.setattr(ctk, "TOPK_CHUNK", 64)
    v = 2048
    x = (np.random.default_rng(15).normal(size=(1, v)) - 5).astype(np.float32)
    x[0, _chunk_ids(v, 64, 0, 20)] = 10 - 0.001 * np.arange(20)
    x[0, _chunk_ids(v, 64, 5, 10)] = 9.9 - 0.001 * np.arange(10)
    args = (jnp.asarray(x), np.array([v], np.int32), np.array([0.75], np.float32),
            np.zeros(1, np.float32))
    got = np.isfinite(np.asarray(jax.jit(lambda *a: filter_logits(*a, chunked=True))(*args)))
    want, ambiguous = np_keep_mask(x, *args[1:])
    assert not ambiguous.any() and want.sum() == 22
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("raw", ["0", "16", "abc", "-5"])
def test_a_bad_chunk_setting_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDJAX_TOPK_CHUNK", raw)
    with pytest.raises(ValueError, match="PAGEDJAX_TOPK_CHUNK"):
        ctk._chunk_from_env()
    monkeypatch.setenv("PAGEDJAX_TOPK_CHUNK", "512")
    assert ctk._chunk_from_env() == 512
