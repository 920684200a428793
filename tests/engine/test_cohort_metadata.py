"""A steady cohort's sampling metadata kept across its steps (`worker.cohort_metadata`):
kept, advanced and cut down, it equals what `SamplingMetadata.from_params` builds from the
same rows; in the engine, every steady step's sampler call gets the same metadata as with
the cache off, for sampled, seeded, filtered, biased, masked, penalised and min_tokens rows,
with async scheduling on and off, under preemption, and with penalty histories packed on the
host (which refuse cohorts with a penalised row), and the outputs are identical."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.sampler import DeviceFill, SamplingMetadata, SeqSamplingState
from pagedjax.worker.cohort_metadata import CohortMetadata
from tests.engine.helpers import finished_key
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

VOCAB = 64


def _leaves_equal(a: SamplingMetadata, b: SamplingMetadata, what: str = "") -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb, strict=True):
        assert type(x) is type(y), what  # numpy vs device arguments are different jit keys
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        np.testing.assert_array_equal(x, y, what)


class _Cohort:
    def __init__(self, key: int, parent=None) -> None:
        self.key, self.parent = key, parent


def _random_params(rng) -> SamplingParams:
    penalised = rng.random() < 0.3
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.6, 1.0])), top_k=int(rng.choice([-1, 5, 200])),
        top_p=float(rng.choice([1.0, 0.8])), min_p=float(rng.choice([0.0, 0.1])),
        seed=None if rng.random() < 0.5 else int(rng.integers(0, 2**33)),
        logprobs=None if rng.random() < 0.6 else int(rng.integers(0, 3)), max_tokens=100,
        presence_penalty=0.4 if penalised else 0.0,
        repetition_penalty=float(rng.choice([1.0, 1.3])) if penalised else 1.0,
        logit_bias={5: 2.0} if rng.random() < 0.15 else None)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("device", [False, True])
def test_kept_and_cut_equal_from_params(seed, device):
    rng = np.random.default_rng(seed)
    fill = DeviceFill() if device else None
    n = int(rng.integers(1, 20))
    b = 1 << int(n - 1).bit_length() if n > 1 else 1
    params = [_random_params(rng) for _ in range(n)]
    pending = int(rng.integers(0, 2))
    # (prompt, outputs, counter, index) per row; outputs grow in place, as a sequence's do.
    seqs = [([1, 2, 3], [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, 9)))],
             int(rng.integers(0, 2**40)), int(rng.integers(0, 3))) for _ in range(n)]

    def fresh(rows: list[int], pad: int) -> SamplingMetadata:
        meta = SamplingMetadata.from_params(
            [(params[i], SeqSamplingState(seqs[i][0], seqs[i][1], seqs[i][2], seqs[i][3],
                                          pending)) for i in rows],
            pad, VOCAB, engine_seed=3, history_width=16, ban_width=4, mask_width=2,
            bias_width=2, fill=fill)
        meta = meta.replace(want_topk=np.bool_(any(params[i].logprobs for i in rows)))
        if meta.output_token_ids.shape[1]:  # present: left to the device, as the engine does
            meta = meta.replace(output_token_ids=None, prompt_token_ids=None)
        return meta

    cache = CohortMetadata(VOCAB, fill)
    cohort = _Cohort(1)
    assert cache.get(cohort, b, pending) is None  # nothing kept yet
    rows = list(range(n))
    cache.keep(cohort, b, fresh(rows, b), [seqs[i][1] for i in rows],
               [bool(params[i].logprobs) for i in rows])
    assert cache.get(cohort, 2 * b, pending) is None  # another sampler batch: built afresh
    cuts = hits = 0
    for step in range(6):
        for i in rows:
            seqs[i][1].append(int(rng.integers(0, VOCAB)))
        written = False
        if step in (2, 4) and len(rows) > 1:  # cut down: some sequences ended
            # A logit bias is written on the device there: not cut, built afresh.
            written = device and any(params[i].logit_bias for i in rows)
            keep = sorted(rng.choice(len(rows), int(rng.integers(1, len(rows))),
                                     replace=False).tolist())
            rows = [rows[k] for k in keep]
            cohort = _Cohort(cohort.key + 1, (cohort.key, keep))
            b = max(1, 1 << int(len(rows) - 1).bit_length())
            cuts += not written
        got = cache.get(cohort, b, pending)
        if written:
            assert got is None
            cache.keep(cohort, b, fresh(rows, b), [seqs[i][1] for i in rows],
                       [bool(params[i].logprobs) for i in rows])
            got = cache.get(cohort, b, pending)
        hits += 1
        assert got is not None
        _leaves_equal(got, fresh(rows, b), f"step {step}")
    assert cache.num_cuts == cuts and cache.num_hits == hits
    assert cache.get(_Cohort(99), b, pending) is None  # an unrelated cohort


def test_written_wide_arrays_are_not_cut_and_refusals_hold():
    fill = DeviceFill()
    outs = [[1], [2], [3]]
    biased = SamplingParams(temperature=0.5, logit_bias={3: 1.0}, max_tokens=9)
    plain = SamplingParams(temperature=0.5, max_tokens=9)
    rows = [(p, SeqSamplingState([1], o, i, 0)) for i, (p, o) in
            enumerate(zip([plain, biased, plain], outs, strict=True))]
    meta = SamplingMetadata.from_params(rows, 4, VOCAB, ban_width=4, mask_width=2, bias_width=2,
                                        history_width=8, fill=fill)
    cache = CohortMetadata(VOCAB, fill)
    cache.keep(_Cohort(1), 4, meta, outs, [False] * 3)
    assert cache.get(_Cohort(1), 4, 0) is not None  # kept whole: the bias rows are fixed
    # Cut down, the bias array would have to be cut on the device: built afresh instead.
    assert cache.get(_Cohort(2, (1, [0, 2])), 2, 0) is None
    # Its empty ban and mask arrays alone are replaced by the new batch's empty ones.
    plain_rows = [rows[0], rows[2], (plain, SeqSamplingState([1], [4], 5, 0))]
    penalised = SamplingParams(temperature=0.5, presence_penalty=0.3, max_tokens=9)
    plain_rows.append((penalised, SeqSamplingState([1], [6], 6, 0)))
    meta = SamplingMetadata.from_params(plain_rows, 4, VOCAB, ban_width=4, mask_width=2,
                                        bias_width=2, history_width=8, fill=fill)
    cache.keep(_Cohort(5), 4, meta.replace(output_token_ids=None, prompt_token_ids=None),
               [r[1].output_token_ids for r in plain_rows], [False] * 4)
    cut = cache.get(_Cohort(6, (5, [1, 3])), 2, 0)
    assert cut is not None and cut.output_token_ids is None
    assert cut.banned_token_ids is fill.blank((2, 4), -1, np.int32)
    np.testing.assert_array_equal(cut.presence_penalty, np.float32([0.0, 0.3]))
    cache.keep(_Cohort(3), 4, meta, [], None)
    assert cache.refused(_Cohort(3)) and not cache.refused(_Cohort(4))
    assert cache.get(_Cohort(3), 4, 0) is None


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 256})
    return config, assemble_params(config, random_hf_tensors(config, seed=9).get)


def _requests(vocab: int, count: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(5)
    allowed = [int(t) for t in rng.choice(np.arange(3, vocab), 20, replace=False)]
    kinds = [dict(temperature=0.9, seed=7, top_p=0.9),
             dict(temperature=0.8, top_k=20),
             dict(temperature=1.0, min_p=0.1, logprobs=2),
             dict(temperature=0.7, logit_bias={5: 3.0, 9: -2.0}),
             dict(temperature=0.9, allowed_token_ids=allowed),
             dict(temperature=0.8, seed=3, min_tokens=12, ignore_eos=True),
             dict(temperature=0, logprobs=1),
             dict(temperature=1.2, seed=11)]
    out = []
    for i in range(count):
        prompt = [int(t) for t in rng.integers(3, vocab, int(rng.integers(3, 30)))]
        kind = kinds[i % len(kinds)]
        if i in (3, 10):  # penalised requests: their histories gathered on the device
            kind = dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2,
                        frequency_penalty=0.2 * (i == 10))
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(10, 60)),
                                                    **kind)))
    return out


def _run(tiny, async_scheduling: bool, mode: str, blocks: int, kept: bool, monkeypatch,
         device_histories: bool = True):
    config, params = tiny
    metas: list[SamplingMetadata] = []
    real_sample = engine_mod.sample

    def sample(x, meta, **kw):
        metas.append(meta)
        return real_sample(x, meta, **kw)

    monkeypatch.setattr(engine_mod, "sample", sample)
    if not kept:
        monkeypatch.setattr(CohortMetadata, "get", lambda self, cohort, b, pending: None)
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=blocks, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                          preemption_mode=mode, swap_space_gb=0.01,
                          async_scheduling=async_scheduling,
                          device_penalty_histories=device_histories)
    engine = llm.engine
    reqs = _requests(config.vocab_size, 14)
    pending = list(reqs)
    results: dict[str, tuple] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 6 == 0:  # arrivals spread over the run
            rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind="final_only")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = finished_key(out)
        step += 1
        assert step < 3000
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return results, metas, engine


@pytest.mark.parametrize("async_scheduling,mode,blocks,device_histories", [
    (False, "recompute", 120, True), (True, "recompute", 120, True), (True, "swap", 14, True),
    (False, "recompute", 14, True), (True, "recompute", 120, False)])
def test_kept_metadata_equals_the_built(tiny, async_scheduling, mode, blocks, device_histories,
                                        monkeypatch):
    with monkeypatch.context() as m:
        built, built_metas, _ = _run(tiny, async_scheduling, mode, blocks, False, m,
                                     device_histories)
    with monkeypatch.context() as m:
        kept, kept_metas, engine = _run(tiny, async_scheduling, mode, blocks, True, m,
                                        device_histories)
    assert set(built) == {f"r{i}" for i in range(14)}
    assert kept == built
    # The same sampler calls, each with the same metadata, argument types included.
    assert len(kept_metas) == len(built_metas)
    for i, (a, b) in enumerate(zip(kept_metas, built_metas, strict=True)):
        _leaves_equal(a, b, f"sampler call {i}")
    cm = engine.cohort_meta
    # Many steps took kept metadata; with room for all, some of it cut down as sequences
    # ended (in the small pool, preemptions break the cohorts up first).
    assert cm.num_hits > 20, cm.num_hits
    if blocks == 120:
        assert cm.num_cuts > 0
    else:
        assert engine.get_stats().num_preemptions_total > 0


@pytest.mark.parametrize("device_histories", [False, True])
def test_penalised_cohorts_with_host_histories_are_refused(tiny, device_histories,
                                                          monkeypatch):
    """With penalty histories packed on the host each step, a cohort with a penalised row is
    never kept, and is not offered again step after step; kept where the device holds them."""
    config, params = tiny
    offers = []
    real_keep = CohortMetadata.keep

    def keep(self, cohort, b, meta, outs, wants):
        offers.append((cohort.key, wants is None))
        return real_keep(self, cohort, b, meta, outs, wants)

    monkeypatch.setattr(CohortMetadata, "keep", keep)
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_num_seqs=4, max_model_len=96,
                          device_penalty_histories=device_histories)
    sps = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0.8, max_tokens=40, presence_penalty=0.3,
                          ignore_eos=True)]
    llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}], sps)
    engine = llm.engine
    assert engine.scheduler.num_steady_steps > 20
    refused = [k for k, r in offers if r]
    if device_histories:
        assert not refused and engine.cohort_meta.num_hits > 20
    else:
        assert refused and len(refused) == len(set(refused))  # each cohort refused once
        assert engine.cohort_meta.num_hits == 0
