"""The native per-row sampler (`pallas_kernels/csrc/sample_rows_cpu.cc`) against `sample`'s
XLA path (the same tokens), against `jax.random.categorical` (the same noise), and against a
float64 numpy model of temperature, top-k, top-p and min-p (token frequencies over many keys,
and no token outside the cut ever drawn). Widths around its 16-lane vectors, ties at the cut,
-inf entries, the logits processing it fuses (penalties, bias, bans, masks), broken rows, rows
that do not depend on their batch, and bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.sampler import (
    SamplingMetadata,
    SeqSamplingState,
    raw_logprob_rows,
    row_keys,
    sample,
)
from pagedjax.sampling_params import _GREEDY_EPS, SamplingParams
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """An XLA:CPU custom call: every case runs on the CPU device, whatever the default."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


_kernel = jax.jit(cpu_native.sample_rows_cpu, static_argnames=("greedy_eps",))


def _native(*args, **kw):
    """The kernel's tokens (its logprobs, ranks, max and log-sum-exp are checked below and
    through `sample`)."""
    return _kernel(*args, **kw)[0]


def _meta(params: list[SamplingParams], v: int) -> SamplingMetadata:
    return SamplingMetadata.from_params([(p, SeqSamplingState([0], [])) for p in params],
                                        len(params), v)


def _same_logprobs(xla, nat, same: np.ndarray, topk: bool) -> int:
    """``nat``'s logprobs, ranks and top logprobs against ``xla``'s on the rows ``same``: the
    values to float rounding of the log-sum-exp, ranks and ids exactly; and where top
    logprobs were computed (``topk``), a row's chosen logprob is the bits of its entry among
    them, as both come from the kernel's max and log-sum-exp. Returns how many rows had their
    token among their top logprobs."""
    np.testing.assert_allclose(np.asarray(nat.logprobs)[same], np.asarray(xla.logprobs)[same],
                               rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(nat.ranks)[same], np.asarray(xla.ranks)[same])
    np.testing.assert_allclose(np.asarray(nat.topk_logprobs)[same],
                               np.asarray(xla.topk_logprobs)[same], rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(nat.topk_ids)[same],
                                  np.asarray(xla.topk_ids)[same])
    if not topk:
        return 0
    ids, top = np.asarray(nat.topk_ids), np.asarray(nat.topk_logprobs)
    tok, lp = np.asarray(nat.token_ids), np.asarray(nat.logprobs)
    found = 0
    for r in range(len(tok)):
        hit = np.nonzero(ids[r] == tok[r])[0]
        if hit.size:
            found += 1
            np.testing.assert_array_equal(top[r, hit[0]], lp[r])
    return found


def _both(x: np.ndarray, params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    meta = _meta(params, x.shape[1])
    rows = np.arange(len(params), dtype=np.int32)
    k = min(5, x.shape[1])
    xla = sample(jnp.asarray(x), meta, num_logprobs=k, rows=rows)
    nat = sample(jnp.asarray(x), meta, num_logprobs=k, rows=rows, native=True)
    # The raw logprob of the same token is XLA's `log_softmax` to float rounding (the kernel
    # sums the exponentials itself, in double), its rank and the top ids are the same.
    same = np.asarray(xla.token_ids) == np.asarray(nat.token_ids)
    _same_logprobs(xla, nat, same, bool(meta.want_topk))
    assert nat.raw_logprobs is None  # beams take `raw_logprob_rows`
    return np.asarray(xla.token_ids), np.asarray(nat.token_ids)


def test_logprob_ranks_and_top_logprobs_match_xla_with_many_ties():
    """Ranks count strictly larger raw logprobs: rows of few distinct values (many ties) and
    top logprobs asked for (``want_topk``), every row greedy or sampled."""
    rng = np.random.default_rng(11)
    v = 3000
    params = [SamplingParams(temperature=float(t), top_p=0.9, seed=i, logprobs=5)
              for i, t in enumerate([0.0, 0.8, 1.0, 0.0, 1.3, 0.5] * 4)]
    x = _logits(rng, len(params), v, "ties")
    meta = _meta(params, v)
    assert bool(meta.want_topk)
    rows = np.arange(len(params), dtype=np.int32)
    xla = sample(jnp.asarray(x), meta, num_logprobs=5, rows=rows)
    nat = sample(jnp.asarray(x), meta, num_logprobs=5, rows=rows, native=True)
    np.testing.assert_array_equal(np.asarray(nat.token_ids), np.asarray(xla.token_ids))
    # Greedy rows (8) take the first maximum, which `top_k` puts first among the tied.
    assert _same_logprobs(xla, nat, np.ones(len(params), bool), topk=True) >= 8
    assert np.asarray(nat.ranks).max() > 1  # sampled rows drew below the maximum
    raw = np.asarray(raw_logprob_rows(jnp.asarray(x), rows))
    np.testing.assert_array_equal(raw, np.asarray(xla.raw_logprobs))


def _logits(rng: np.random.Generator, b: int, v: int, kind: str) -> np.ndarray:
    if kind == "peaked":  # a few likely tokens over a wide tail, like a model's rows
        x = rng.standard_normal((b, v)) * 2.5
        x[:, rng.integers(0, v, size=min(v, 8))] += 8
    elif kind == "flat":  # the nucleus holds most of the vocabulary
        x = rng.standard_normal((b, v)) * 0.3
    else:  # "ties": few distinct values, so cuts fall on runs of equal values
        x = rng.integers(-3, 3, size=(b, v)).astype(np.float64)
    return x.astype(np.float32)


_CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_p=0.95),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_k=40, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.7, min_p=0.05),
    dict(temperature=1.0, top_p=0.01),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("v", [1, 15, 16, 17, 100, 1000, 49152])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
def test_same_tokens_as_the_xla_sampler(v, kind):
    rng = np.random.default_rng(v * 7 + len(kind))
    params = [SamplingParams(**{**c, **({"top_k": min(c["top_k"], v)} if "top_k" in c else {})},
                             seed=int(rng.integers(1 << 31)))
              for c in _CONFIGS for _ in range(2)]
    x = _logits(rng, len(params), v, kind)
    xla, nat = _both(x, params)
    np.testing.assert_array_equal(nat, xla)
    assert nat.dtype == np.int32


def test_mixed_rows_with_banned_entries():
    """A batch mixing every configuration, with -inf entries (bans, masks) in every row."""
    rng = np.random.default_rng(1)
    v = 4099
    params = [SamplingParams(**_CONFIGS[i % len(_CONFIGS)], seed=i) for i in range(37)]
    x = _logits(rng, len(params), v, "peaked")
    x[rng.random(x.shape) < 0.3] = -np.inf
    xla, nat = _both(x, params)
    np.testing.assert_array_equal(nat, xla)


def _processed_batch(rng: np.random.Generator, v: int, greedy: bool):
    """A batch whose logits the processing changes: penalties (negative frequency included)
    over histories that repeat the rows' top tokens, logit bias, min_tokens bans of the EOS,
    structured-output masks, and plain rows beside them."""
    b = 24
    x = _logits(rng, b, v, "peaked")
    top = np.argsort(-x, axis=1)[:, :6]
    rows, masks = [], {}
    for i in range(b):
        kind = i % 6
        out = [int(t) for t in rng.choice(top[i], size=int(rng.integers(1, 9)))]
        out += [int(t) for t in rng.integers(0, v, size=3)]
        prompt = [int(t) for t in rng.integers(0, v, size=5)] + [int(top[i, 0])]
        kw = dict(temperature=0.0 if greedy else float(rng.choice([0.7, 1.0])),
                  top_p=1.0 if greedy else 0.9, seed=i)
        if kind in (0, 1, 2):
            if i % 12 < 6:  # negative logits: repetition multiplies them instead of dividing
                x[i] -= 30.0
            kw.update(presence_penalty=float(rng.choice([0.0, 1.5, -0.5])),
                      frequency_penalty=float(rng.choice([0.0, 0.7, -0.3])),
                      repetition_penalty=float(rng.choice([1.0, 1.8, 0.6])))
        if kind == 3:
            kw["logit_bias"] = {int(top[i, 1]): 30.0, int(top[i, 0]): -50.0}
        if kind == 4:
            kw.update(min_tokens=100, max_tokens=200)  # bans the EOS (token top[4, 0]) below
        if kind == 5:
            allowed = rng.random(v) < 0.2
            bits = np.zeros(-(-v // 32) * 32, bool)
            bits[:v] = allowed
            masks[i] = np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little") \
                .view("<u4").ravel().view(np.int32)  # bit t % 32 of word t // 32
        rows.append((SamplingParams(**kw), SeqSamplingState(prompt, out)))
    eos = int(top[4, 0])
    meta = SamplingMetadata.from_params(rows, b, v, eos_token_id=eos, masks=masks or None)
    return x, meta


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("v", [77, 4096])
def test_processing_matches_the_xla_sampler(greedy, v):
    """Penalties, bias, bans and masks applied in the kernel give `sample`'s tokens, greedy
    rows (the processed argmax, exact) and sampled ones; and the processing changes tokens."""
    x, meta = _processed_batch(np.random.default_rng(v + greedy), v, greedy)
    assert meta.do_penalties and meta.bias_token_ids.shape[1] and \
        meta.banned_token_ids.shape[1] and meta.allowed_bitmask.shape[1]
    rows = np.arange(x.shape[0], dtype=np.int32)
    xla = np.asarray(sample(jnp.asarray(x), meta, rows=rows).token_ids)
    nat = np.asarray(sample(jnp.asarray(x), meta, rows=rows, native=True).token_ids)
    np.testing.assert_array_equal(nat, xla)
    plain = meta.replace(output_token_ids=meta.output_token_ids[:, :0],
                         prompt_token_ids=meta.prompt_token_ids[:, :0],
                         bias_token_ids=meta.bias_token_ids[:, :0],
                         bias_values=meta.bias_values[:, :0],
                         banned_token_ids=meta.banned_token_ids[:, :0],
                         allowed_bitmask=meta.allowed_bitmask[:, :0])
    unprocessed = np.asarray(sample(jnp.asarray(x), plain, rows=rows, native=True).token_ids)
    assert (unprocessed != nat).sum() >= len(nat) // 4
    if greedy:  # masked rows draw allowed tokens only
        bits = np.asarray(meta.allowed_bitmask).view(np.uint32)
        for i in range(len(nat)):
            if (bits[i] != 0xFFFFFFFF).any():
                assert (bits[i, nat[i] >> 5] >> (nat[i] & 31)) & 1


def test_noise_is_jax_gumbel():
    """Pure temperature sampling of a flat row is the argmax of the noise alone: the token of
    `jax.random.categorical` with the row's key, for every key (an independent reference for
    the threefry stream and the noise's float conversion)."""
    b, v = 64, 3001
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(b)]
    meta = _meta(params, v)
    keys = row_keys(meta)
    x = np.zeros((b, v), np.float32)
    got = np.asarray(_native(jnp.asarray(x), meta.temperature, meta.top_k, meta.top_p,
                             meta.min_p, jax.random.key_data(keys), greedy_eps=_GREEDY_EPS))
    want = np.asarray(jax.vmap(lambda k: jax.random.categorical(k, jnp.zeros(v)))(keys))
    np.testing.assert_array_equal(got, want)
    assert len(set(got.tolist())) > b // 2  # the keys differ, so do the tokens


def _model(x: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """float64 probabilities after temperature, top-k, top-p (the shortest descending prefix
    whose mass reaches p, ties of its last value kept) and min-p."""
    xs = x.astype(np.float64) / t
    order = np.sort(xs)[::-1]
    kth = order[min(k, len(xs)) - 1]
    e = np.where(xs >= kth, np.exp(xs - xs.max()), 0.0)
    cut = kth
    if p < 1.0:
        vals = np.unique(xs[xs >= kth])[::-1]
        above = 0.0
        for val in vals:
            tied = e[xs == val].sum()
            if above + tied >= p * e.sum():
                cut = val
                break
            above += tied
    if min_p > 0:
        cut = max(cut, xs.max() + np.log(min_p))
    e = np.where(xs >= cut, np.exp(xs - xs.max()), 0.0)
    return e / e.sum()


@pytest.mark.parametrize("cfg", [dict(t=1.0, k=12, p=1.0, min_p=0.0),
                                 dict(t=0.7, k=12, p=0.8, min_p=0.0),
                                 dict(t=1.5, k=5, p=1.0, min_p=0.0),
                                 dict(t=1.0, k=12, p=1.0, min_p=0.2),
                                 dict(t=1.2, k=8, p=0.9, min_p=0.05)])
def test_token_frequencies_follow_a_float64_model(cfg):
    """One row drawn with 20 000 keys: tokens outside the cut never appear, and each kept
    token's frequency is within 5 standard deviations of the float64 model's probability."""
    rng = np.random.default_rng(7)
    v, n = 12, 20_000
    row = (rng.standard_normal(v) * 1.5).astype(np.float32)
    want = _model(row, cfg["t"], cfg["k"], cfg["p"], cfg["min_p"])
    x = np.broadcast_to(row, (n, v)).copy()
    keys = jax.random.key_data(jax.random.split(jax.random.key(3), n))
    got = np.asarray(_native(jnp.asarray(x), jnp.full(n, cfg["t"]), jnp.full(n, cfg["k"]),
                             jnp.full(n, cfg["p"]), jnp.full(n, cfg["min_p"]), keys,
                             greedy_eps=_GREEDY_EPS))
    freq = np.bincount(got, minlength=v) / n
    assert (freq[want == 0] == 0).all()
    sd = np.sqrt(want * (1 - want) / n)
    assert (np.abs(freq - want) <= 5 * sd + 1e-12).all(), (freq, want)
    assert (want > 0).sum() >= 2  # the cut keeps several tokens: the test is not vacuous


def test_broken_rows():
    """A NaN row takes its first NaN, as greedy rows do; a row of all -inf index 0; an
    infinite logit its first +inf; greedy rows their first maximum."""
    v = 33
    x = np.zeros((5, v), np.float32)
    x[0, [4, 9]] = np.nan
    x[1] = -np.inf
    x[2, [7, 20]] = np.inf
    x[3, [2, 30]] = 5.0  # greedy: the first of two maxima
    x[4, 11] = np.nan  # greedy NaN row
    t = np.array([1.0, 1.0, 1.0, 0.0, 0.0], np.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 5))
    got = np.asarray(_native(jnp.asarray(x), jnp.asarray(t), jnp.full(5, v), jnp.full(5, 0.9),
                             jnp.zeros(5), keys, greedy_eps=_GREEDY_EPS))
    np.testing.assert_array_equal(got, [4, 0, 7, 2, 11])


def test_a_row_does_not_depend_on_its_batch():
    """Each row's token is the same alone as in a batch (the rows are spread over threads)."""
    rng = np.random.default_rng(5)
    b, v = 9, 2048
    params = [SamplingParams(**_CONFIGS[i % len(_CONFIGS)], seed=i) for i in range(b)]
    meta = _meta(params, v)
    x = _logits(rng, b, v, "flat")
    keys = jax.random.key_data(row_keys(meta))
    args = (meta.temperature, meta.top_k, meta.top_p, meta.min_p, keys)
    whole = np.asarray(_native(jnp.asarray(x), *args, greedy_eps=_GREEDY_EPS))
    for i in range(b):
        one = _native(jnp.asarray(x[i:i + 1]), *(a[i:i + 1] for a in args),
                      greedy_eps=_GREEDY_EPS)
        assert int(one[0]) == whole[i]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(0, 2**31 - 1), st.sampled_from(range(len(_CONFIGS))),
       st.sampled_from(["peaked", "flat", "ties"]))
def test_random_rows_match_the_xla_sampler(v, seed, cfg, kind):
    rng = np.random.default_rng(seed)
    c = dict(_CONFIGS[cfg])
    if "top_k" in c:
        c["top_k"] = int(rng.integers(1, v + 1))
    params = [SamplingParams(**c, seed=int(rng.integers(1 << 31))) for _ in range(3)]
    xla, nat = _both(_logits(rng, 3, v, kind), params)
    np.testing.assert_array_equal(nat, xla)


def test_bad_arguments():
    z = jnp.zeros(2)
    keys = jnp.zeros((2, 2), jnp.uint32)
    x = jnp.zeros((2, 64))
    with pytest.raises(TypeError, match="float32"):
        cpu_native.sample_rows_cpu(jnp.zeros((2, 8), jnp.bfloat16), z, z, z, z, keys, 1e-5)
    with pytest.raises(ValueError, match="keys"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys[:1], 1e-5)
    with pytest.raises(ValueError, match="output_ids"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys, 1e-5, output_ids=jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match="bias_values"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys, 1e-5, bias_ids=jnp.zeros((2, 4)),
                                   bias_values=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="bitmask"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys, 1e-5, bitmask=jnp.zeros((2, 1)))


def test_rows_are_read_in_place_and_unlisted_rows_never_read():
    """``rows`` picks (and repeats) rows of the step's logits: the same tokens, logprobs,
    ranks, max and log-sum-exp as the gathered rows, whatever the unlisted rows hold (NaN
    here, which would poison any row that read them)."""
    rng = np.random.default_rng(21)
    b, v = 7, 1000
    params = [SamplingParams(**_CONFIGS[i % len(_CONFIGS)], seed=i, presence_penalty=0.3)
              for i in range(b)]
    meta = _meta(params, v)
    good = _logits(rng, 4, v, "peaked")
    step = np.full((9, v), np.nan, np.float32)  # rows 1, 3, 4, 8 are the listed ones
    step[[1, 3, 4, 8]] = good
    rows = np.array([8, 1, 1, 4, 3, 8, 4], np.int32)
    keys = jax.random.key_data(row_keys(meta))
    args = (meta.temperature, meta.top_k, meta.top_p, meta.min_p, keys)
    kw = dict(greedy_eps=_GREEDY_EPS, output_ids=meta.output_token_ids,
              prompt_ids=meta.prompt_token_ids, presence=meta.presence_penalty)
    in_place = _kernel(jnp.asarray(step), *args, rows=jnp.asarray(rows), **kw)
    gathered = _kernel(jnp.asarray(step[rows]), *args, **kw)
    for a, g in zip(in_place, gathered, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(g))
    assert np.isfinite(np.asarray(in_place[1])).all()
    # `sample` passes its rows through: the same as sampling the gathered rows.
    nat = sample(jnp.asarray(step), meta, num_logprobs=3, rows=rows, native=True)
    np.testing.assert_array_equal(np.asarray(nat.token_ids), np.asarray(in_place[0]))


def test_log_sum_exp_against_float64():
    """The raw max is exact and the log-sum-exp within float rounding of float64's, over
    widths around the kernel's 16- and 64-value blocks and the demo vocabulary; the logprob
    is (x_t - max) - lse in float."""
    rng = np.random.default_rng(8)
    for v in (1, 15, 16, 17, 63, 64, 65, 1000, 49152):
        b = 4
        x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
        params = [SamplingParams(temperature=1.0, seed=i) for i in range(b)]
        meta = _meta(params, v)
        tok, lp, rank, mx, lse = (np.asarray(a) for a in _kernel(
            jnp.asarray(x), meta.temperature, meta.top_k, meta.top_p, meta.min_p,
            jax.random.key_data(row_keys(meta)), greedy_eps=_GREEDY_EPS))
        x64 = x.astype(np.float64)
        np.testing.assert_array_equal(mx, x.max(axis=1))
        ref = np.log(np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1))
        np.testing.assert_allclose(lse, ref, rtol=3e-7, atol=1e-7)
        picked = x[np.arange(b), tok]
        np.testing.assert_array_equal(lp, (picked - mx) - lse)
        raw = (x - mx[:, None]) - lse[:, None]
        np.testing.assert_array_equal(rank, (raw > lp[:, None]).sum(axis=1) + 1)


def test_broken_rows_logprobs_are_nan_like_xla():
    """A NaN row, an all -inf row and a row with +inf: the max and log-sum-exp are those of
    XLA's formula (NaN log-sum-exp, hence NaN logprob, rank 1)."""
    v = 40
    x = np.zeros((3, v), np.float32)
    x[0, 5] = np.nan
    x[1] = -np.inf
    x[2, 9] = np.inf
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    meta = _meta(params, v)
    _, lp, rank, mx, lse = (np.asarray(a) for a in _kernel(
        jnp.asarray(x), meta.temperature, meta.top_k, meta.top_p, meta.min_p,
        jax.random.key_data(row_keys(meta)), greedy_eps=_GREEDY_EPS))
    xla = sample(jnp.asarray(x), meta, num_logprobs=0)
    assert np.isnan(mx[0]) and mx[1] == -np.inf and mx[2] == np.inf
    assert np.isnan(lse).all() and np.isnan(lp).all()
    np.testing.assert_array_equal(np.isnan(np.asarray(xla.logprobs)), np.isnan(lp))
    np.testing.assert_array_equal(rank, np.asarray(xla.ranks))


def test_rows_outside_the_logits_are_refused():
    z = jnp.zeros(2)
    keys = jnp.zeros((2, 2), jnp.uint32)
    x = jnp.zeros((3, 64))
    with pytest.raises(ValueError, match="rows"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys, 1e-5, rows=jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="keys"):
        cpu_native.sample_rows_cpu(x, z, z, z, z, keys, 1e-5, rows=jnp.zeros(3, jnp.int32))
    for bad in ([0, 3], [-1, 0]):
        with pytest.raises(Exception, match=r"rows must lie in \[0, T\)"):
            jax.block_until_ready(_kernel(x, z, z, z, z, keys, greedy_eps=1e-5,
                                           rows=jnp.asarray(bad, jnp.int32)))
