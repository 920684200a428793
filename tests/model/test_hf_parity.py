"""Our Flax Llama vs HF transformers on the demo GGUF (goldens recorded by tools/make_goldens.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.reference import ReferenceGenerator


@pytest.fixture(scope="module")
def ref(demo_model):
    config, params = demo_model
    return ReferenceGenerator(config, params)


def test_tokenizer_matches_hf(demo_tokenizer, hf_goldens):
    for case in hf_goldens["logits"]:
        assert demo_tokenizer(case["prompt"]).input_ids == case["input_ids"]
    for case in hf_goldens["chat"]:
        text = demo_tokenizer.apply_chat_template(
            [{"role": "user", "content": case["prompt"]}], tokenize=False, add_generation_prompt=True)
        assert text == case["chat_text"]
        assert demo_tokenizer(text).input_ids == case["input_ids"]
    assert demo_tokenizer.eos_token_id == hf_goldens["eos_token_id"]


def test_logits_match_hf(ref, hf_goldens):
    sample = np.asarray(hf_goldens["vocab_sample"])
    assert len(hf_goldens["logits"]) >= 3
    lengths = {len(c["input_ids"]) for c in hf_goldens["logits"]}
    assert len(lengths) == len(hf_goldens["logits"])  # prompts of different lengths
    for case in hf_goldens["logits"]:
        ours = ref.prompt_logits(case["input_ids"])
        hf_sample = np.asarray(case["sample_logits"])
        scale = np.abs(hf_sample).max()
        # fp32 on both sides; differences come from summation order only.
        np.testing.assert_allclose(ours[:, sample], hf_sample, atol=1e-3 * scale, rtol=0)
        np.testing.assert_allclose(ours[-1], np.asarray(case["last_logits"]), atol=1e-3 * scale, rtol=0)
        top10 = np.asarray(case["top10_ids"])
        np.testing.assert_array_equal(ours.argmax(-1), top10[:, 0])
        np.testing.assert_allclose(np.take_along_axis(ours, top10, -1),
                                   np.asarray(case["top10_logits"]), atol=1e-3 * scale, rtol=0)


def test_greedy_chat_continuations_match_hf(ref, demo_model, hf_goldens):
    config, _ = demo_model
    cases = hf_goldens["chat"]
    long_cases = [c for c in cases if len(c["output_ids"]) >= 32]
    assert len(long_cases) >= 3
    outs = ref.generate([c["input_ids"] for c in cases], 48, eos_token_ids=config.eos_token_ids)
    for out, case in zip(outs, cases):
        assert out == case["output_ids"], case["prompt"]


def test_live_hf_when_torch_available(ref, demo_gguf, hf_goldens):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name,
                                                 dtype=torch.float32)
    ids = hf_goldens["logits"][0]["input_ids"]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    ours = ref.prompt_logits(ids)
    np.testing.assert_allclose(ours, hf, atol=1e-3 * np.abs(hf).max(), rtol=0)
