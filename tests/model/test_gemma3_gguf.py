"""The second real model: Gemma 3 270M (Q4_K_M GGUF from PyPI) against HF transformers.

Goldens from `tools/make_gemma3_goldens.py` (HF loading the same GGUF in fp32). The file
mixes Q4_K, Q6_K, Q5_0 and Q8_0 tensors, has sliding-window layers (5 local : 1 global,
window 512) with two rotary bases, q/k norms, sandwich norms and a 262k vocabulary, so this
exercises the GGUF K-quant path, the Gemma switches and the SentencePiece tokenizer at once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.demo import GEMMA3_270M, ensure_model
from models.gguf_loader import load_gguf
from models.tokenizer import load_tokenizer
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.conftest import DATA
from tests.engine.test_engine_e2e import assert_pool_whole

GOLDENS = json.loads((DATA / "gemma3_goldens.json").read_text())


@pytest.fixture(scope="module")
def gemma_path():
    return ensure_model(GEMMA3_270M)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return load_gguf(gemma_path)


@pytest.fixture(scope="module")
def tokenizer(gemma_path):
    return load_tokenizer(gemma_path)


def test_config_is_gemma3_270m(gemma):
    config, _ = gemma
    assert config.architecture == "gemma3" and config.num_layers == 18
    assert config.windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4
    assert config.qk_norm and config.sandwich_norm and config.embed_scale
    assert tuple(config.eos_token_ids) == tuple(GOLDENS["eos_token_ids"])


def test_tokenizer_matches_hf(tokenizer):
    for case in GOLDENS["logits"]:
        assert tokenizer(case["prompt"], add_special_tokens=False).input_ids == case["text_ids"]
        assert tokenizer(case["prompt"]).input_ids == case["input_ids"]  # BOS added
    for case in GOLDENS["chat"]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": case["prompt"]}],
                                             tokenize=False, add_generation_prompt=True)
        assert text == case["chat_text"]
        assert tokenizer(text, add_special_tokens=False).input_ids == case["input_ids"]


def test_logits_match_hf(gemma):
    config, params = gemma
    ref = ReferenceGenerator(config, params)
    sample = np.asarray(GOLDENS["vocab_sample"])
    for case in GOLDENS["logits"]:
        ours = ref.prompt_logits(case["input_ids"])
        hf = np.asarray(case["sample_logits"])
        tol = 1e-3 * np.abs(hf).max()  # fp32 both sides; summation order differs
        np.testing.assert_allclose(ours[:, sample], hf, atol=tol, rtol=0)
        top10 = np.asarray(case["top10_ids"])
        np.testing.assert_array_equal(ours.argmax(-1), top10[:, 0])
        np.testing.assert_allclose(np.take_along_axis(ours, top10, -1),
                                   np.asarray(case["top10_logits"]), atol=tol, rtol=0)


def test_greedy_chat_matches_hf_reference_and_engine(gemma, tokenizer):
    config, params = gemma
    cases = GOLDENS["chat"]
    ref = ReferenceGenerator(config, params).generate(
        [c["input_ids"] for c in cases], 40, eos_token_ids=config.eos_token_ids)
    for out, case in zip(ref, cases, strict=True):
        assert out == case["output_ids"], case["prompt"]
    # The paged engine, prefix caching on, the same prompts twice (the second round hits).
    llm = LLM.from_params(config, params, tokenizer, num_gpu_blocks=48, block_size=16,
                          max_num_seqs=4, max_model_len=256, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=40)
    prompts = [{"prompt_token_ids": c["input_ids"]} for c in cases] * 2
    outs = llm.generate(prompts, sp)
    for out, case in zip(outs, cases * 2, strict=True):
        got = list(out.outputs[0].token_ids)
        assert got == case["output_ids"], case["prompt"]
    assert_pool_whole(llm)
