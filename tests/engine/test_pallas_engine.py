"""The engine with the Pallas kernels (interpret mode on CPU) on a small random Llama."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("fused_norm", ["0", "1"])
def test_pallas_backend_engine_matches_reference(monkeypatch, fused_norm):
    """Greedy tokens equal the contiguous reference's, with XLA's norms and with the fused
    residual add + RMSNorm kernel a GPU runner uses (`fused_norm_fn`; interpreted here)."""
    from pallas_kernels import add_rms_norm as norm_module

    calls = []
    real = norm_module.add_rms_norm
    monkeypatch.setattr(norm_module, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("PAGEDJAX_FUSED_NORM", fused_norm)
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 2})
    params = assemble_params(cfg, random_hf_tensors(cfg, seed=4).get)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (5, 17, 33, 9)]
    llm = LLM.from_params(cfg, params, _NoTokenizer(), num_gpu_blocks=24, block_size=8, max_num_seqs=4,
                          max_num_batched_tokens=64, attention_backend="pallas")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    want = ReferenceGenerator(cfg, params).generate(prompts, 12)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert bool(calls) == (fused_norm == "1")
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 24


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mosaic_kernels_in_engine_keep_greedy_outputs(monkeypatch, kv_cache_dtype):
    """bf16, head dim 64: prefill and decode steps on the Mosaic GPU kernels (interpreted)
    give the same greedy tokens as the Triton kernels (interpreted), with three sequences
    sharing a small pool, over a bf16 cache and an int8 one (calibrated scales); the pool is
    whole afterwards. The layers run unrolled: the interpreter's callbacks are effects, which
    flax's layer scan refuses (the compiled kernel lowers under the scan: the H100 step in
    pagedjax.aot does)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import mosaic_decode_attention as mdec
    from pallas_kernels import mosaic_ragged_attention as mrag
    from pallas_kernels.backend import ENV_LOWERING, interpret_mode

    if not mdec.mosaic_available() or not (interpret_mode() or mdec.hopper_target()):
        pytest.skip("the Mosaic kernels need the Mosaic GPU API (jax >= 0.11.2) and, compiled, a Hopper")

    cfg = ModelConfig.from_hf({**TINY_HF_CONFIG, "hidden_size": 128, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "head_dim": 64})
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                          assemble_params(cfg, random_hf_tensors(cfg, seed=9).get))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (5, 30, 17)]
    calls = []
    for mod, name in ((mdec, "mosaic_paged_decode"), (mrag, "mosaic_ragged_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n)
                            or _r(*a, **k))
    outs = {}
    for lowering in ("mosaic", "triton"):
        calls.clear()
        monkeypatch.setenv(ENV_LOWERING, lowering)
        llm = LLM.from_params(cfg, params, _NoTokenizer(), num_gpu_blocks=5, block_size=16,
                              max_num_seqs=3, max_num_batched_tokens=64,
                              attention_backend="pallas", layer_loop="unrolled",
                              kv_cache_dtype=kv_cache_dtype)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        outs[lowering] = [o.outputs[0].token_ids for o in res]
        # 7 blocks' worth of tokens for a pool of 5: some step preempted a sequence.
        assert llm.engine.get_stats().num_preemptions_total > 0
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.get_num_free_gpu_blocks() == 5
        if lowering == "mosaic":
            assert set(calls) == {"mosaic_paged_decode", "mosaic_ragged_attention"}
    assert outs["mosaic"] == outs["triton"]
