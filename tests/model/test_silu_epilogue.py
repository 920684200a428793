"""silu(gate) * up in the native gate_up matmul's epilogue (`DecoderLayer._silu_epilogue`,
`models.qlinear.Linear.silu_mul`): the unrolled float32 model on panels gives the logits and
cache of the separate activation (PAGEDJAX_SILU_EPILOGUE=0) within float rounding; the lowered
step holds one epilogue call per layer exactly where it applies (a silu MLP on the native
matmul), none for a GELU model or without the kernel; `Linear(silu_mul=True)` on a plain
kernel is silu of the first half times the second."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.decoder import ContiguousAttention, ContiguousMeta, DecoderLM, unstack_layers
from models.qlinear import Linear, dense_panelize
from models.weights import assemble_params
from pallas_kernels import cpu_native
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.model.test_fused_norm import GEMMA2

native = pytest.mark.skipif(not cpu_native.available(),
                            reason="native CPU kernels need a C++ compiler")


def _lowered_and_out(cfg, params, matmul):
    model = DecoderLM(cfg, ContiguousAttention(), jnp.float32, scan_layers=False,
                      packed_matmul=matmul)
    p = unstack_layers(params)
    if matmul is not None:
        p = dense_panelize(p)
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
    pos = jnp.asarray(np.where(np.arange(12) < [[12], [9]], np.arange(12), -1), jnp.int32)
    shape = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape), jnp.zeros(shape))
    fn = jax.jit(lambda p: model.apply({"params": p}, ids, pos, cache, ContiguousMeta(pos)))
    return fn.lower(p).as_text(), fn(p)


@native
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_epilogue_keeps_logits_and_cache(family, monkeypatch):
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG if family == "llama" else GEMMA2)
    params = assemble_params(cfg, random_hf_tensors(cfg, seed=13).get)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDJAX_SILU_EPILOGUE", flag)
        runs[flag] = _lowered_and_out(cfg, params, cpu_native.packed_matmul_cpu)
    calls = runs["1"][0].count(cpu_native.DENSE_SILU_MUL_TARGET)
    assert calls == (cfg.num_layers if family == "llama" else 0)
    assert cpu_native.DENSE_SILU_MUL_TARGET not in runs["0"][0]
    (got, (gk, gv)), (want, (wk, wv)) = runs["1"][1], runs["0"][1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(wk), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=2e-5, atol=2e-5)


def test_no_epilogue_without_the_native_matmul(monkeypatch):
    """XLA's dots (the GPU's and TP's path): the graph has no epilogue call."""
    monkeypatch.delenv("PAGEDJAX_SILU_EPILOGUE", raising=False)
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    params = assemble_params(cfg, random_hf_tensors(cfg, seed=13).get)
    text, _ = _lowered_and_out(cfg, params, None)
    assert "silu_mul" not in text


def test_linear_silu_mul_on_a_plain_kernel():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 10)), jnp.float32)
    got = Linear(10, silu_mul=True).apply({"params": {"kernel": kernel}}, x)
    y = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    want = y[:, :5] / (1 + np.exp(-y[:, :5])) * y[:, 5:]
    assert got.shape == (3, 5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
