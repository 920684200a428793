"""The Flax Llama against an independent numpy forward pass (incl. Llama-3 rope, GQA, bf16)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors


def numpy_llama_logits(cfg: ModelConfig, t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    x = t["model.embed_tokens.weight"][ids].astype(np.float64)
    n = len(ids)
    inv = cfg.rope_inv_freq().astype(np.float64)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def rope(v):  # v [n, heads, d]
        h = v.shape[-1] // 2
        a, b = v[..., :h], v[..., h:]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    for i in range(cfg.num_layers):
        p = lambda name: t[f"model.layers.{i}.{name}"].astype(np.float64)  # noqa: B023
        h = norm(x, p("input_layernorm.weight"))
        q = rope((h @ p("self_attn.q_proj.weight").T).reshape(n, cfg.num_heads, cfg.head_dim))
        k = rope((h @ p("self_attn.k_proj.weight").T).reshape(n, cfg.num_kv_heads, cfg.head_dim))
        v = (h @ p("self_attn.v_proj.weight").T).reshape(n, cfg.num_kv_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, v).reshape(n, -1)
        x = x + o @ p("self_attn.o_proj.weight").T
        h = norm(x, p("post_attention_layernorm.weight"))
        g = h @ p("mlp.gate_proj.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    x = norm(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    return x @ head.T.astype(np.float64)


@pytest.mark.parametrize("variant", ["default", "llama3_tied"])
def test_flax_llama_matches_numpy(variant):
    hf = dict(TINY_HF_CONFIG)
    if variant == "llama3_tied":
        hf.update(tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    cfg = ModelConfig.from_hf(hf)
    tensors = random_hf_tensors(cfg, seed=7)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 23))
    want = numpy_llama_logits(cfg, tensors, ids)
    got = ReferenceGenerator(cfg, assemble_params(cfg, tensors.get)).prompt_logits(ids)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)

    # bf16 compute stays close (looser bound, same argmax on confident positions).
    got16 = ReferenceGenerator(cfg, assemble_params(cfg, tensors.get, jnp.bfloat16),
                               jnp.bfloat16).prompt_logits(ids)
    np.testing.assert_allclose(got16, want, atol=5e-2 * np.abs(want).max(), rtol=0)


def test_decode_steps_match_full_prefill():
    """Greedy tokens from the cached decode loop equal recomputing everything each step."""
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    tensors = random_hf_tensors(cfg, seed=11)
    gen = ReferenceGenerator(cfg, assemble_params(cfg, tensors.get))
    prompt = [5, 17, 3, 44, 9]
    out = gen.generate([prompt, prompt[:2]], 12)
    for p, o in zip([prompt, prompt[:2]], out):
        seq = list(p)
        for tok in o:
            assert int(np.argmax(numpy_llama_logits(cfg, tensors, seq)[-1])) == tok
            seq.append(tok)
