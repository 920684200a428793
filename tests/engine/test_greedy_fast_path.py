"""Plain greedy batches sample through `sample_greedy` (argmax per logits row, then picked by
rows; on one CPU device the native one-pass kernel) and produce exactly what `sample`
produces: tokens, cumulative logprobs, the sampled token's logprob for `logprobs=0`, stop
ids, under preemption; batches with a sampled, penalised, beam or top-logprob row take
`sample`."""

from __future__ import annotations

import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.sampler import SamplingMetadata
from pallas_kernels import cpu_native
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(3)
    prompt = lambda: [int(t) for t in rng.integers(3, vocab, int(rng.integers(2, 40)))]  # noqa: E731
    plain = [(prompt(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
             for _ in range(6)]
    plain += [(prompt(), SamplingParams(temperature=0, max_tokens=10, logprobs=0)),
              (prompt(), SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[5, 9, 40])),
              # Its stop ids are banned for 4 tokens: those steps need the full sampler.
              (prompt(), SamplingParams(temperature=0, max_tokens=9, min_tokens=4,
                                        stop_token_ids=[5, 9, 40]))]
    mixed = [(prompt(), SamplingParams(temperature=0.8, seed=4, max_tokens=8)),
             (prompt(), SamplingParams(temperature=0, max_tokens=8, logprobs=3)),
             (prompt(), SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.4))]
    return plain, mixed


def _generate(config, params, reqs, monkeypatch, fast: bool) -> tuple[list, int, int, int]:
    """Outputs, `sample_greedy` calls, preemptions, sampling metadata built."""
    calls, metas = [], []
    # Every metadata, built row by row or from the persistent batch, is assembled once.
    real, real_meta = engine_mod.sample_greedy, SamplingMetadata.assemble.__func__

    def counting(*a, **k):
        calls.append(k.get("native", False))
        return real(*a, **k)

    def counting_meta(cls, *a, **k):
        metas.append(1)
        return real_meta(cls, *a, **k)

    monkeypatch.setattr(engine_mod, "sample_greedy", counting)
    monkeypatch.setattr(SamplingMetadata, "assemble", classmethod(counting_meta))
    if not fast:
        monkeypatch.setattr(engine_mod, "GREEDY_FAST_PATH", False)
    # 14 blocks of 8 for 9 sequences of up to 50 tokens: preemption is certain.
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=14, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs])
    engine = llm.engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    monkeypatch.undo()
    # On one CPU device the fast path is the native one-pass kernel, where it builds.
    assert all(native is cpu_native.available() for native in calls)
    return outs, len(calls), engine.get_stats().num_preemptions_total, len(metas)


@pytest.mark.parametrize("batch", ["plain", "mixed"])
def test_fast_path_outputs_equal_the_full_sampler(tiny, monkeypatch, batch):
    config, params = tiny
    plain, mixed = _requests(config.vocab_size)
    reqs = plain if batch == "plain" else mixed
    fast, n_fast, pre, meta_fast = _generate(config, params, reqs, monkeypatch, fast=True)
    full, n_full, _, meta_full = _generate(config, params, reqs, monkeypatch, fast=False)
    assert n_full == 0
    if batch == "plain":
        assert n_fast > 0 and pre > 0  # the fast path ran, under preemption
        # Steps of plain rows only build no sampling metadata; those with the min_tokens
        # row before its 4th token do (and sample through `sample`).
        assert 0 < meta_fast < meta_full
    else:
        assert n_fast == 0  # a sampled, top-logprob or penalised row in every step
        assert meta_fast == meta_full
    for a, b in zip(fast, full, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            if y.logprobs is None:  # no logprobs asked: none reported (as vLLM V1)
                assert x.cumulative_logprob is None and y.cumulative_logprob is None
            else:
                np.testing.assert_allclose(x.cumulative_logprob, y.cumulative_logprob, atol=1e-5)
            if y.logprobs is not None:
                for dx, dy in zip(x.logprobs, y.logprobs, strict=True):
                    assert dx.keys() == dy.keys()
                    np.testing.assert_allclose(list(dx.values()), list(dy.values()), atol=1e-5)
