"""`DecoderLM.norm_fn`: the fused residual add + RMSNorm (the Pallas kernel
`pallas_kernels.add_rms_norm`, interpreted here, and the native CPU one
`cpu_native.add_rms_norm_cpu`) gives the model's logits and cache, under the layer scan and
unrolled, with logits rows picked and not, for a Llama and for a Gemma-2-style layer (sandwich
norms, the 1 + w weights); and the runner picks each where it says it does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.decoder import ContiguousAttention, ContiguousMeta, DecoderLM, unstack_layers
from models.weights import assemble_params
from pagedjax.worker.model_runner import ENV_FUSED_NORM, fused_norm_fn
from pallas_kernels import cpu_native
from pallas_kernels.add_rms_norm import add_rms_norm
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors

GEMMA2 = {**TINY_HF_CONFIG, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
          "hidden_size": 48, "head_dim": 16, "query_pre_attn_scalar": 16,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh",
          "tie_word_embeddings": True}


def _forward(cfg, params, norm_fn, scan, pick):
    model = DecoderLM(cfg, ContiguousAttention(), jnp.float32, scan_layers=scan, norm_fn=norm_fn)
    p = params if scan else unstack_layers(params)
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
    pos = jnp.asarray(np.where(np.arange(12) < [[12], [9]], np.arange(12), -1), jnp.int32)
    shape = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape), jnp.zeros(shape))
    rows = jnp.asarray([11, 20], jnp.int32) if pick else None
    return jax.jit(lambda p: model.apply({"params": p}, ids, pos, cache, ContiguousMeta(pos),
                                         logits_indices=rows))(p)


@pytest.mark.parametrize("kernel", ["pallas", "native_cpu"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("pick", [True, False], ids=["rows", "all"])
def test_fused_norm_keeps_logits_and_cache(kernel, family, scan, pick):
    if kernel == "native_cpu" and not cpu_native.available():
        pytest.skip("native CPU kernels need a C++ compiler")
    norm = add_rms_norm if kernel == "pallas" else cpu_native.add_rms_norm_cpu
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG if family == "llama" else GEMMA2)
    if family == "gemma2":
        assert cfg.sandwich_norm and cfg.final_softcap
    params = assemble_params(cfg, random_hf_tensors(cfg, seed=11).get)
    calls = []

    def counted(*a):
        calls.append(a[1] is None)
        return norm(*a)

    want, (wk, wv) = _forward(cfg, params, None, scan, pick)
    got, (gk, gv) = _forward(cfg, params, counted, scan, pick)
    # Unrolled: two norms a layer and the final one; only the first layer's attention norm
    # has no pending output to add. A scan's body (traced more than once) always has one.
    if scan:
        assert len(calls) >= 3 and not any(calls)
    else:
        assert calls == [True] + [False] * (2 * cfg.num_layers)
    assert got.shape == want.shape == ((2, cfg.vocab_size) if pick else (2, 12, cfg.vocab_size))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(wk), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=2e-5, atol=2e-5)


def test_runner_picks_the_fused_norm_on_one_gpu_with_pallas_and_one_cpu(monkeypatch):
    monkeypatch.delenv(ENV_FUSED_NORM, raising=False)
    monkeypatch.delenv("PAGEDJAX_ATTENTION_BACKEND", raising=False)
    assert fused_norm_fn(None, 1, "gpu") is add_rms_norm
    assert fused_norm_fn("pallas", 1, "cuda") is add_rms_norm
    native = cpu_native.add_rms_norm_cpu if cpu_native.available() else None
    assert fused_norm_fn(None, 1, "cpu") is native
    assert fused_norm_fn(None, 2, "cpu") is None
    assert fused_norm_fn(None, 2, "gpu") is None
    assert fused_norm_fn("xla", 1, "gpu") is None
    monkeypatch.setenv("PAGEDJAX_ATTENTION_BACKEND", "xla")
    assert fused_norm_fn(None, 1, "gpu") is None
    monkeypatch.setenv(ENV_FUSED_NORM, "1")
    assert fused_norm_fn(None, 1, "cpu") is add_rms_norm
    monkeypatch.setenv(ENV_FUSED_NORM, "0")
    monkeypatch.delenv("PAGEDJAX_ATTENTION_BACKEND")
    assert fused_norm_fn(None, 1, "gpu") is None
    assert fused_norm_fn(None, 1, "cpu") is None
    monkeypatch.setenv(ENV_FUSED_NORM, "yes")
    with pytest.raises(ValueError, match=ENV_FUSED_NORM):
        fused_norm_fn(None, 1, "gpu")
