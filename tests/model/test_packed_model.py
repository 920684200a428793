"""Weight-only quantized inference (`EngineConfig.quantization`): GGUF tensors kept packed on the
device and int8 per-channel quantization of float checkpoints.

- "gguf" computes the numbers the dequantized-float path computes (later): prompt logprobs
  within float error and identical greedy tokens, on the demo model (Q4_1 projections, Q8_0
  embedding) and on Gemma 3 270M (Q5_0, Q4_K, Q6_K, Q8_0 mixed across layers), through the
  native CPU kernel and through XLA's dequantization, scanned and unrolled layer loops;
  resident weight bytes at most 1.3x the file.
- Llama-layout GGUFs (permuted Q/K rows) and Phi-3's fused qkv / gate-up tensors load packed
  to the same model as their float loads.
- "int8": a quarter of fp32's weight bytes, outputs close to fp32; a weight swap with float
  params re-quantizes them.
- Errors name the field.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from models.demo import GEMMA3_270M, ensure_model
from models.gguf_loader import load_gguf
from models.qlinear import is_packed
from pagedjax import LLM, SamplingParams
from tests.engine.test_engine_e2e import assert_pool_whole

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.",
           "List three prime numbers.", "Explain why the sky is blue."]


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _prompt_logprobs(llm: LLM, ids: list[list[int]]) -> np.ndarray:
    res = llm.generate([{"prompt_token_ids": p} for p in ids],
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.asarray([d[t] for r, p in zip(res, ids, strict=True)
                       for d, t in zip(r.prompt_logprobs[1:], p[1:], strict=True)])


def _chat_ids(tok, n: int = 4) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                    add_generation_prompt=True) for p in PROMPTS[:n]]


def _compare(path, tok, native: bool, loop: str, tol: float, n: int = 4, max_tokens: int = 24):
    """Float vs packed engines on the same ``n`` prompts: logprobs and greedy tokens."""
    cf, pf = load_gguf(path)
    cq, pq = load_gguf(path, packed=True)
    assert cq == cf
    assert is_packed(pq["embed"]) and any(is_packed(v) for v in pq["layers"].values())
    assert _bytes(pq) <= 1.3 * os.path.getsize(path)
    ids = [list(getattr(x, "input_ids", x)) for x in _chat_ids(tok, n)]
    old = os.environ.get("PAGEDJAX_NATIVE_CPU")
    os.environ["PAGEDJAX_NATIVE_CPU"] = "1" if native else "0"
    from pallas_kernels import cpu_native

    cpu_native.available.cache_clear()
    try:
        kw = dict(num_gpu_blocks=96, block_size=16, max_model_len=256, layer_loop=loop)
        float_llm = LLM.from_params(cf, pf, tok, **kw)
        packed_llm = LLM.from_params(cq, pq, tok, quantization="gguf", **kw)
        assert (packed_llm.engine.runner.model.packed_matmul is not None) == native
        a, b = _prompt_logprobs(float_llm, ids), _prompt_logprobs(packed_llm, ids)
        np.testing.assert_allclose(b, a, atol=tol, rtol=0)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        ga = [o.outputs[0].token_ids for o in float_llm.generate(
            [{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)]
        gb = [o.outputs[0].token_ids for o in packed_llm.generate(
            [{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)]
        assert ga == gb
        # Demo: 92 vs 513 MiB; Gemma 3 (an 8-bit embedding): 278 vs 1023 MiB.
        assert packed_llm.engine.get_stats().weights_bytes < float_llm.engine.get_stats(
            ).weights_bytes / 3.5
        assert_pool_whole(packed_llm)
    finally:
        if old is None:
            os.environ.pop("PAGEDJAX_NATIVE_CPU", None)
        else:
            os.environ["PAGEDJAX_NATIVE_CPU"] = old
        cpu_native.available.cache_clear()


@pytest.mark.parametrize("native,loop", [(True, "unrolled"), (False, "scan")])
def test_demo_gguf_packed_equals_float(demo_gguf, demo_tokenizer, native, loop):
    # Two prompts, 12 tokens (CI time): every row runs the same packed layouts.
    _compare(demo_gguf, demo_tokenizer, native, loop, tol=2e-4, n=2, max_tokens=12)


def test_gemma3_gguf_packed_equals_float():
    from models.tokenizer import load_tokenizer

    path = ensure_model(GEMMA3_270M)
    # Two prompts, 12 tokens: its 262k-token head made this CI's slowest test (214 s) with
    # four and 24; the packed Gemma layouts are the same in every row.
    _compare(path, load_tokenizer(path), True, "unrolled", tol=2e-3, n=2, max_tokens=12)


@pytest.mark.parametrize("family,arch", [("llama3", "llama"), ("phi3", "phi3")])
def test_packed_gguf_layouts(tmp_path, family, arch):
    """Q/K rows permuted by llama.cpp's converter, and Phi-3's fused qkv / gate-up, packed:
    the same logits as the float load of the same file (Q8_0 weights)."""
    from models.hf_loader import load_hf_dir
    from models.weights import params_to_hf
    from tests.model.helpers import write_gguf
    from tests.model.test_families import write_family
    from tests.parallel.tp_script import NoTokenizer

    write_family(family, tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    path = write_gguf(tmp_path / "m.gguf", cfg, params_to_hf(cfg, params), quant="Q8_0",
                      arch=arch)
    cf, pf = load_gguf(path)
    cq, pq = load_gguf(path, packed=True)
    assert is_packed(pq["layers"]["q_proj"]) and is_packed(pq["layers"]["gate_proj"])
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, cf.vocab_size, 12)]
               for i in range(3)]
    kw = dict(num_gpu_blocks=32, block_size=8, max_model_len=128)
    a = _prompt_logprobs(LLM.from_params(cf, pf, NoTokenizer(), **kw), prompts)
    b = _prompt_logprobs(LLM.from_params(cq, pq, NoTokenizer(), quantization="gguf", **kw),
                         prompts)
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_int8_weights(demo_model, demo_tokenizer):
    config, params = demo_model
    kw = dict(num_gpu_blocks=96, block_size=16, max_model_len=256)
    full = LLM.from_params(config, params, demo_tokenizer, **kw)
    q8 = LLM.from_params(config, params, demo_tokenizer, quantization="int8", **kw)
    fb, qb = full.engine.get_stats().weights_bytes, q8.engine.get_stats().weights_bytes
    assert qb < 0.27 * fb  # int8 codes + one float32 scale per output channel
    ids = [list(getattr(x, "input_ids", x)) for x in _chat_ids(demo_tokenizer)]
    a, b = _prompt_logprobs(full, ids), _prompt_logprobs(q8, ids)
    # Per-channel int8 of the demo model (whose float weights are themselves dequantized
    # Q4_1): mean |d logprob| 0.13 over these prompts' tokens.
    assert 0 < np.mean(np.abs(a - b)) < 0.2
    # A weight swap with float params: quantized on the way in, the same outputs again.
    before = q8.generate([{"prompt_token_ids": p} for p in ids],
                         SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    q8.update_params(params)
    after = q8.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in before] == [o.outputs[0].token_ids for o in after]
    assert_pool_whole(q8)


def test_quantization_errors_name_the_field(tmp_path, demo_model, demo_tokenizer):
    from models.loader import load_model
    from pagedjax.config import EngineConfig
    from tests.model.test_families import write_family

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    write_family("llama3", tmp_path)
    with pytest.raises(ValueError, match="quantization: 'gguf'"):
        load_model(tmp_path, quantization="gguf")
    config, params = demo_model
    with pytest.raises(ValueError, match="quantization: 'gguf'"):
        LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=8, quantization="gguf")
