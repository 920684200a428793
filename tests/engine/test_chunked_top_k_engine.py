"""The engine with GPUs' two-stage top-k (`PAGEDJAX_CHUNKED_TOPK=1`, forced here on the CPU,
XLA's sampler branches) gives what the one-stage sampler gives: sampled tokens seed by seed,
top logprobs and prompt logprobs, on the demo model's real logits."""

from __future__ import annotations

import numpy as np

from pagedjax import LLM, SamplingParams
from tests.engine.test_engine_e2e import assert_pool_whole


def _run(monkeypatch, demo_model, demo_tokenizer, chunked: str):
    monkeypatch.setenv("PAGEDJAX_NATIVE_SAMPLER", "0")  # XLA's branches, as on a GPU
    monkeypatch.setenv("PAGEDJAX_CHUNKED_TOPK", chunked)
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8)
    assert not llm.engine.runner.native_sampler
    assert llm.engine.runner.chunked_top_k == (chunked == "1")
    rng = np.random.default_rng(21)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, config.vocab_size, n)]}
               for n in (5, 17, 9, 30)]
    params_ = [SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=10, logprobs=20,
                              prompt_logprobs=20),
               SamplingParams(temperature=1.0, top_k=50, seed=2, max_tokens=10, logprobs=3),
               SamplingParams(temperature=0.7, top_k=200, top_p=0.95, min_p=0.02, seed=3,
                              max_tokens=10, presence_penalty=0.5),
               SamplingParams(temperature=1.3, seed=4, max_tokens=10, n=2, logprobs=20)]
    outs = llm.generate(prompts, params_)
    assert_pool_whole(llm)
    return outs


def _summary(outs):
    rows = []
    for o in outs:
        rows.append(("prompt", [sorted(d.items()) if d else d for d in (o.prompt_logprobs or [])]))
        for c in o.outputs:
            rows.append((c.token_ids, [sorted(d.items()) for d in (c.logprobs or [])]))
    return rows


def test_engine_outputs_equal_with_the_two_stage_top_k(monkeypatch, demo_model, demo_tokenizer):
    one = _run(monkeypatch, demo_model, demo_tokenizer, "0")
    two = _run(monkeypatch, demo_model, demo_tokenizer, "1")
    assert _summary(two) == _summary(one)
    assert any(len(c.logprobs[0]) >= 20 for o in one for c in o.outputs if c.logprobs)
