"""Sampler vs an independent numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.sampler import (
    SamplingMetadata,
    SeqSamplingState,
    apply_penalties,
    filter_logits,
    prompt_logprobs,
    sample,
    sample_greedy,
)
from pagedjax.sampling_params import SamplingParams

V = 512


# ------------------------------------------------------------ numpy reference
def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.astype(np.float64).copy()
    for i in range(out.shape[0]):
        counts = np.bincount(np.asarray(output[i], int), minlength=out.shape[1])
        seen = counts > 0
        seen[np.asarray(prompt[i], int)] = True
        row = out[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / repetition[i], row[seen] * repetition[i])
        out[i] = row - frequency[i] * counts - presence[i] * (counts > 0)
    return out


def np_keep_mask(logits, top_k, top_p, min_p):
    """Return (kept mask, ambiguous) for each row; ambiguous = top-p mass lands
    within 1e-4 of the cutoff, where fp32 vs fp64 rounding may legitimately differ."""
    keep = np.ones(logits.shape, bool)
    ambiguous = np.zeros(logits.shape[0], bool)
    for i, row in enumerate(logits.astype(np.float64)):
        k = top_k[i] if 0 < top_k[i] < row.size else row.size
        order = np.argsort(-row, kind="stable")
        kth = row[order[k - 1]]
        m = row >= kth
        if top_p[i] < 1.0:
            masked = np.where(m, row, -np.inf)
            p = np.exp(masked - masked.max())
            p /= p.sum()
            sp = p[np.argsort(-masked, kind="stable")]
            before = np.cumsum(sp) - sp
            n_keep = max(int((before < top_p[i]).sum()), 1)
            ambiguous[i] = np.any(np.abs(before - top_p[i]) < 1e-4)
            cutoff = np.sort(masked)[::-1][n_keep - 1]
            m &= row >= cutoff
        if min_p[i] > 0:
            prob = np.exp(row - row.max())
            m &= prob >= min_p[i] - 1e-12
            ambiguous[i] |= np.any(np.abs(prob - min_p[i]) < 1e-5)
        keep[i] = m
    return keep, ambiguous


def meta_for(params, states, pad_to, vocab=V, **kw) -> SamplingMetadata:
    return SamplingMetadata.from_params(list(zip(params, states)), pad_to, vocab, **kw)


def st(out=(), prompt=(1, 2, 3), counter=0, seq_index=0) -> SeqSamplingState:
    return SeqSamplingState(list(prompt), list(out), counter, seq_index)


# ---------------------------------------------------------------------- tests
def test_penalties_match_numpy_exactly() -> None:
    rng = np.random.default_rng(0)
    b = 6
    logits = rng.normal(size=(b, V)).astype(np.float32) * 3
    prompts = [rng.integers(0, V, rng.integers(1, 40)).tolist() for _ in range(b)]
    outputs = [rng.integers(0, 60, rng.integers(0, 50)).tolist() for _ in range(b)]
    pres = rng.uniform(-2, 2, b).astype(np.float32)
    freq = rng.uniform(-2, 2, b).astype(np.float32)
    rep = rng.uniform(0.5, 2.0, b).astype(np.float32)
    params = [SamplingParams(temperature=0, presence_penalty=float(pres[i]),
                             frequency_penalty=float(freq[i]),
                             repetition_penalty=float(rep[i])) for i in range(b)]
    meta = meta_for(params, [st(outputs[i], prompts[i]) for i in range(b)], pad_to=8)
    assert meta.do_penalties and meta.output_token_ids.shape[1] == 64  # bucketed
    got = apply_penalties(jnp.asarray(np.pad(logits, ((0, 2), (0, 0)))),
                          meta.prompt_token_ids, meta.output_token_ids,
                          meta.presence_penalty, meta.frequency_penalty,
                          meta.repetition_penalty)[:b]
    want = np_penalties(logits, prompts, outputs, meta.presence_penalty,
                        meta.frequency_penalty, meta.repetition_penalty)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    # Greedy sampling picks the argmax of the penalised logits.
    out = sample(np.pad(logits, ((0, 2), (0, 0))), meta)
    np.testing.assert_array_equal(np.asarray(out.token_ids[:b]), want.argmax(-1))


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    logits[2, [7, 100, 300]] = 50.0  # exact tie
    meta = meta_for([SamplingParams(temperature=0)] * 4, [st()] * 4, pad_to=4)
    assert meta.all_greedy
    out = sample(logits, meta)
    want = logits.argmax(-1)
    assert want[2] == 7
    np.testing.assert_array_equal(np.asarray(out.token_ids), want)
    # Greedy rows inside a mixed batch behave identically.
    mixed = meta_for([SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2,
                     [st()] * 4, pad_to=4)
    out = sample(logits, mixed)
    np.testing.assert_array_equal(np.asarray(out.token_ids)[[0, 2]], want[[0, 2]])


FILTERS = [  # (top_k, top_p, min_p)
    (5, 1.0, 0.0), (1, 1.0, 0.0), (-1, 0.9, 0.0), (-1, 0.3, 0.0), (-1, 1.0, 0.05),
    (40, 0.8, 0.0), (40, 0.95, 0.02), (V + 100, 0.5, 0.0), (-1, 1.0, 0.0), (3, 0.05, 0.0),
]


def test_filter_masks_match_numpy() -> None:
    rng = np.random.default_rng(2)
    b = len(FILTERS)
    logits = (rng.normal(size=(b, V)) * rng.uniform(0.5, 4, (b, 1))).astype(np.float32)
    top_k = np.array([f[0] if f[0] > 0 else V for f in FILTERS], np.int32)
    top_p = np.array([f[1] for f in FILTERS], np.float32)
    min_p = np.array([f[2] for f in FILTERS], np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p, min_p)))
    want, ambiguous = np_keep_mask(logits, top_k, top_p, min_p)
    assert not ambiguous.any()
    np.testing.assert_array_equal(got, want)
    # Kept logits are untouched.
    kept = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p, min_p))
    np.testing.assert_array_equal(kept[want], logits[want])


@pytest.mark.parametrize("candidates", [1, 64, 128, V])
def test_top_k_top_p_thresholds_from_candidates_and_search_match_numpy(monkeypatch, candidates):
    """Both ways to a threshold, against float64 numpy: read from the top candidates (peaked
    rows, k within them) and the exact bisection (flat rows, k past the candidates; with one
    candidate almost every row searches, with V none does). Ties cross the boundaries."""
    import pagedjax.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "TOP_CANDIDATES", candidates)
    rng = np.random.default_rng(5)
    rows, settings = [], []
    for scale in (0.3, 1.0, 4.0, 12.0):  # flat .. peaked
        for k, p in ((-1, 0.9), (-1, 0.5), (-1, 0.99), (10, 0.9), (100, 0.95), (300, 1.0),
                     (100, 1.0), (64, 0.7), (1, 0.5), (V - 1, 0.8)):
            row = rng.normal(size=V) * scale
            if k in (64, 100):
                row = np.round(row, 1)  # ties, also at the k-th value and past the candidates
            rows.append(row)
            settings.append((k if k > 0 else V, p))
    logits = np.asarray(rows, np.float32)
    top_k = np.array([k for k, _ in settings], np.int32)
    top_p = np.array([p for _, p in settings], np.float32)
    min_p = np.zeros(len(rows), np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p, min_p)))
    want, ambiguous = np_keep_mask(logits, top_k, top_p, min_p)
    assert ambiguous.sum() <= 2
    np.testing.assert_array_equal(got[~ambiguous], want[~ambiguous])


def test_sampled_tokens_lie_in_filtered_set_with_temperature() -> None:
    rng = np.random.default_rng(3)
    b, temp = len(FILTERS), 0.7
    logits = rng.normal(size=(b, V)).astype(np.float32) * 2
    params = [SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=m, seed=i)
              for i, (k, p, m) in enumerate(FILTERS)]
    meta = meta_for(params, [st()] * b, pad_to=b)
    want, ambiguous = np_keep_mask(logits / temp, meta.top_k, meta.top_p, meta.min_p)
    assert not ambiguous.any()

    @jax.jit
    def many(seeds):
        return jax.vmap(lambda s: sample(logits, meta.replace(seed=s)).token_ids)(seeds)

    toks = np.asarray(many(jnp.arange(400 * b, dtype=jnp.uint32).reshape(400, b)))
    for i in range(b):
        assert want[i, toks[:, i]].all(), FILTERS[i]
        # Small kept sets are fully covered, i.e. nothing extra is masked.
        if want[i].sum() <= 5:
            assert set(toks[:, i].tolist()) == set(np.flatnonzero(want[i]).tolist())


@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_empirical_frequencies_match_softmax(temp: float) -> None:
    vs, n = 16, 16384
    rng = np.random.default_rng(4)
    row = rng.normal(size=vs).astype(np.float32)
    logits = np.broadcast_to(row, (n, vs))
    params = [SamplingParams(temperature=temp)] * n
    meta = meta_for(params, [st(counter=i) for i in range(n)], pad_to=n, vocab=vs,
                    engine_seed=1234)
    toks = np.asarray(sample(logits, meta).token_ids)
    p = np.exp(np_log_softmax(row / temp))
    obs = np.bincount(toks, minlength=vs)
    chi2 = float(((obs - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 45.0, chi2  # df=15: p(chi2 > 45) ~ 1e-4


def test_logprobs_match_numpy_log_softmax() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(5, V)).astype(np.float32) * 4
    params = [SamplingParams(temperature=0, repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=1, top_k=10),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0), ]
    meta = meta_for(params, [st(out=[int(logits[0].argmax())])] + [st()] * 3, pad_to=5)
    out = sample(logits, meta, num_logprobs=4)
    ref = np_log_softmax(logits)  # raw model distribution, before penalties
    toks = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(5), toks], rtol=1e-5)
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(np.asarray(out.topk_ids), order)
    np.testing.assert_allclose(np.asarray(out.topk_logprobs),
                               np.take_along_axis(ref, order, -1), rtol=1e-5)
    ranks = (ref > ref[np.arange(5), toks][:, None]).sum(-1) + 1
    np.testing.assert_array_equal(np.asarray(out.ranks), ranks)
    assert toks[0] != logits[0].argmax()  # penalised away, yet logprob is raw
    assert sample(logits, meta).topk_ids.shape == (5, 0)


def test_greedy_constant_outputs_come_from_the_host() -> None:
    """`sample_greedy`'s ranks and top logprobs do not depend on the logits: they are cached,
    read-only host arrays (nothing to fetch from the device), the same objects every call."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, V)).astype(np.float32))
    rows = np.array([0, 1, 2, 3], np.int32)
    a = sample_greedy(logits, rows, num_logprobs=2)
    b = sample_greedy(logits * 2, rows, num_logprobs=2)
    for x, y in zip((a.ranks, a.topk_logprobs, a.topk_ids), (b.ranks, b.topk_logprobs,
                                                            b.topk_ids), strict=True):
        assert isinstance(x, np.ndarray) and not x.flags.writeable and x is y
    assert isinstance(a.token_ids, jax.Array) and isinstance(a.logprobs, jax.Array)
    np.testing.assert_array_equal(a.ranks, np.ones(4, np.int32))


def test_greedy_fast_path_matches_sample_and_numpy() -> None:
    """`sample_greedy` (plain greedy batches, no top logprobs) gives `sample`'s tokens and ranks
    exactly and its logprobs (float64 numpy within 1e-5), with rows repeated (n > 1 fan-out),
    tied maxima (the first wins) and a NaN row; and only plain greedy metadata qualifies."""
    rng = np.random.default_rng(7)
    r, b = 6, 9
    logits = rng.normal(size=(r, V)).astype(np.float32) * 4
    logits[2, [17, 300]] = logits[2].max() + 1.0  # a tie: index 17 must win
    logits[4, 99] = np.nan
    rows = np.array([0, 1, 2, 2, 3, 4, 5, 5, 0], np.int32)
    meta = meta_for([SamplingParams(temperature=0)] * b, [st()] * b, b).replace(
        want_topk=np.bool_(False))
    assert meta.plain_greedy
    ref = sample(jnp.asarray(logits), meta, num_logprobs=4, rows=rows)
    got = sample_greedy(jnp.asarray(logits), rows, num_logprobs=4)
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(ref.token_ids))
    assert int(got.token_ids[2]) == 17
    np.testing.assert_array_equal(np.asarray(got.ranks), np.asarray(ref.ranks))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), rtol=1e-6,
                               atol=1e-6)
    fine = rows != 4  # the NaN row's logprob is NaN on both paths
    want = np_log_softmax(logits)[rows, np.asarray(got.token_ids)]
    np.testing.assert_allclose(np.asarray(got.logprobs)[fine], want[fine], rtol=1e-5)
    assert np.isnan(np.asarray(got.logprobs)[~fine]).all() and np.isnan(np.asarray(ref.logprobs)[~fine]).all()
    assert got.topk_ids.shape == (b, 4) and not np.asarray(got.topk_ids).any()
    # Anything that changes the logits, or a sampled row, takes `sample`.
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, presence_penalty=0.5),
              SamplingParams(temperature=0, logit_bias={3: 1.0}),
              SamplingParams(temperature=0, min_tokens=4)):
        other = meta_for([SamplingParams(temperature=0), p], [st(), st()], 2, eos_token_id=1,
                         history_width=8, ban_width=4, bias_width=4)
        assert not other.plain_greedy, p


def test_prompt_logprobs_helper() -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(7, V)).astype(np.float32)
    nxt = rng.integers(0, V, 7)
    got = prompt_logprobs(logits, nxt, k=3)
    ref = np_log_softmax(logits)
    np.testing.assert_allclose(np.asarray(got.token_logprobs), ref[np.arange(7), nxt], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.topk_ids), np.argsort(-ref, -1)[:, :3])
    np.testing.assert_array_equal(
        np.asarray(got.ranks), (ref > ref[np.arange(7), nxt][:, None]).sum(-1) + 1)


def test_seeded_row_is_independent_of_batch_composition() -> None:
    rng = np.random.default_rng(7)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=float(rng.uniform(0.2, 2)), top_k=int(rng.integers(1, 50)),
                             seed=None if i % 2 else int(rng.integers(1 << 30)))
              for i in range(7)]
    out_a: list[int] = []
    out_b: list[int] = []
    for _ in range(6):
        row = rng.normal(size=V).astype(np.float32)
        alone = sample(row[None], meta_for([target], [st(out_a)], pad_to=1)).token_ids
        batch_logits = rng.normal(size=(8, V)).astype(np.float32)
        batch_logits[5] = row
        params = others[:5] + [target] + others[5:]
        states = [st(rng.integers(0, V, rng.integers(0, 9)).tolist(), counter=i)
                  for i in range(8)]
        states[5] = st(out_b)
        mixed = sample(batch_logits, meta_for(params, states, pad_to=8)).token_ids
        out_a.append(int(alone[0]))
        out_b.append(int(mixed[5]))
    assert out_a == out_b
    # Another sequence of the same seeded request (n > 1) gets its own stream.
    logits = np.zeros((1, V), np.float32)
    a = [int(sample(logits, meta_for([target], [st(list(range(s)))], 1)).token_ids[0])
         for s in range(6)]
    b = [int(sample(logits, meta_for([target], [st(list(range(s)), seq_index=1)], 1))
             .token_ids[0]) for s in range(6)]
    assert a != b
    # Key derivation is exactly fold_in(key(seed), step).
    step = 3
    meta = meta_for([SamplingParams(temperature=1.0, seed=42)], [st([0] * step)], 1)
    want = jax.random.categorical(jax.random.fold_in(jax.random.key(42), step), logits[0])
    assert int(sample(logits, meta).token_ids[0]) == int(want)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    eos, stop_id = 2, 9
    logits = np.zeros((3, V), np.float32)
    logits[:, eos] = 30.0
    logits[:, stop_id] = 29.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id]),
              SamplingParams(temperature=1.0, seed=0, min_tokens=3, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)]
    for n_out in range(5):
        meta = meta_for(params, [st([5] * n_out)] * 3, pad_to=4, eos_token_id=eos)
        toks = np.asarray(sample(np.pad(logits, ((0, 1), (0, 0))), meta).token_ids)[:3]
        if n_out < 3:
            assert eos not in toks[:2] and stop_id not in toks[:2]
            assert toks[2] == eos  # ignore_eos: EOS is not banned, stop ids are
        else:
            assert toks[0] == eos and toks[2] == eos
    meta = meta_for(params[:1], [st([5] * 3)], pad_to=1, eos_token_id=eos)
    assert meta.banned_token_ids.shape[1] == 0  # nothing banned once reached


def test_min_tokens_bans_every_eos_id() -> None:
    """Models with several EOS ids (Llama 3: <|end_of_text|>, <|eot_id|>) get all banned."""
    eos_ids = (2, 7)
    logits = np.zeros((1, V), np.float32)
    logits[0, 7] = 30.0
    logits[0, 2] = 29.0
    logits[0, 11] = 28.0
    p = [SamplingParams(temperature=0, min_tokens=2)]
    early = meta_for(p, [st([5])], pad_to=1, eos_token_ids=eos_ids)
    assert int(sample(logits, early).token_ids[0]) == 11
    done = meta_for(p, [st([5, 5])], pad_to=1, eos_token_ids=eos_ids)
    assert int(sample(logits, done).token_ids[0]) == 7
    ignore = meta_for([SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)], [st([5])],
                      pad_to=1, eos_token_ids=eos_ids)
    assert int(sample(logits, ignore).token_ids[0]) == 7


def test_unseeded_rows_follow_engine_seed_and_request_counter() -> None:
    logits = np.zeros((4, V), np.float32)
    params = [SamplingParams(temperature=1.0)] * 4
    states = [st(counter=c) for c in (0, 0, 1, 2)]
    a = np.asarray(sample(logits, meta_for(params, states, 4, engine_seed=5)).token_ids)
    b = np.asarray(sample(logits, meta_for(params, states, 4, engine_seed=5)).token_ids)
    c = np.asarray(sample(logits, meta_for(params, states, 4, engine_seed=6)).token_ids)
    np.testing.assert_array_equal(a, b)
    assert a[0] == a[1] and len(set(a[1:].tolist())) == 3 and not (a == c).all()


def test_from_params_shapes_and_padding() -> None:
    p = SamplingParams(temperature=0.5, top_k=V + 7, frequency_penalty=0.5)
    meta = meta_for([p], [st(out=list(range(17)))], pad_to=3)
    assert meta.top_k.tolist() == [V, V, V] and not meta.do_top_k_top_p
    assert meta.output_token_ids.shape == (3, 32) and meta.prompt_token_ids.shape == (3, 0)
    assert meta.temperature.tolist() == [0.5, 0.0, 0.0] and meta.step.tolist() == [17, 0, 0]
    with pytest.raises(ValueError, match="pad_to"):
        meta_for([p, p], [st(), st()], pad_to=1)


def test_first_argmax_matches_jnp_argmax_with_ties_nan_and_inf() -> None:
    from pagedjax.sampler import categorical, first_argmax

    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, (64, 257)).astype(np.float32)  # many ties
    x[5, 17] = np.nan
    x[6] = -np.inf
    x[7, [3, 9]] = np.inf
    x[8, [4, 6]] = np.nan
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))),
                                  np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    logits = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    for i in range(20):
        key = jax.random.key(i)
        assert int(categorical(key, logits)) == int(jax.random.categorical(key, logits))


def test_sampler_never_sorts_the_vocabulary() -> None:
    """A sort of [rows, vocab] costs XLA:CPU 250 ms at 64 x 49152; XLA also turns `top_k` back
    into one when its result feeds whole-row work in some patterns (see
    `_top_k_top_p_threshold`). The compiled sampler, top-k/top-p/logprobs on, has none."""
    import re

    b, v = 8, 1024
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=40, logprobs=5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5)] * (b // 2)
    meta = meta_for(params, [st()] * b, pad_to=b)
    hlo = sample.lower(jnp.zeros((b, v), jnp.float32), meta, num_logprobs=20,
                       rows=np.arange(b, dtype=np.int32)).compile().as_text()
    assert "TopK" in hlo or "top_k" in hlo.lower()
    sorts = [line for line in hlo.splitlines() if re.search(rf"f32\[{b},{v}\].*\bsort\(", line)]
    assert not sorts, sorts[:2]


def test_gumbel_at_equals_the_full_draw() -> None:
    from pagedjax.sampler import gumbel_at, gumbel_at_supported

    assert gumbel_at_supported()
    v = 49152
    rng = np.random.default_rng(7)
    for i in range(8):
        key = jax.random.fold_in(jax.random.key(int(rng.integers(2**31))), i)
        ids = jnp.asarray(rng.choice(v, 64, replace=False), jnp.int32)
        full = jax.random.gumbel(key, (v,), jnp.float32)
        np.testing.assert_array_equal(np.asarray(gumbel_at(key, ids)), np.asarray(full[ids]))


@pytest.mark.parametrize("scale", [8.0, 1.0])
def test_sampling_among_candidates_draws_the_full_vocabulary_token(monkeypatch, scale) -> None:
    """Peaked rows (kept set within the candidates) take the candidate draw; it must give
    the token the whole-vocabulary Gumbel draw gives, seed by seed. Flat rows fall back."""
    import pagedjax.sampler as sampler_mod

    rng = np.random.default_rng(8)
    b = 16
    logits = (rng.normal(size=(b, V)) * scale).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.uniform(0.5, 1.2)), top_p=0.9,
                             top_k=[-1, 20][i % 2], min_p=[0.0, 0.01][i % 3 == 0], seed=i)
              for i in range(b)]
    meta = meta_for(params, [st()] * b, pad_to=b)
    got = [np.asarray(sample(logits, meta.replace(seed=meta.seed + s)).token_ids)
           for s in range(30)]
    monkeypatch.setattr(sampler_mod, "gumbel_at_supported", lambda: False)
    sample_full = jax.jit(sampler_mod.sample.__wrapped__, static_argnames=("num_logprobs",))
    want = [np.asarray(sample_full(logits, meta.replace(seed=meta.seed + s)).token_ids)
            for s in range(30)]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
