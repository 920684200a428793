"""The unrolled layer loop (the serving default on GPU and one CPU device) computes what
the scanned layers compute.

The suite runs the scan (tests/conftest.py sets PAGEDJAX_LAYER_LOOP=scan for compile time);
these tests pin the loop explicitly: per-layer params from `unstack_layers`, greedy outputs
under preemption and weight swaps, and the demo model's HF chat goldens.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.decoder import FUSED_PROJECTIONS, split_fused, unstack_layers
from models.weights import abstract_params, assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.reference import ReferenceGenerator
from pagedjax.worker.model_runner import resolve_layer_loop
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def test_unstack_layers_splits_arrays_and_shapes(tiny):
    config, params = tiny
    flat = unstack_layers(params)
    assert "layers" not in flat and set(params) - {"layers"} <= set(flat)
    assert [k for k in flat if k.startswith("layer_")] == [f"layer_{i}" for i in range(config.num_layers)]
    stacked = params["layers"]
    fused_from = {n for names in FUSED_PROJECTIONS.values() for n in names}
    for i in range(config.num_layers):
        layer = flat[f"layer_{i}"]
        assert set(layer) == (set(stacked) - fused_from) | set(FUSED_PROJECTIONS)
        for name in set(stacked) - fused_from:  # norms: layer i of the stack
            for a, b in zip(jax.tree.leaves(layer[name]), jax.tree.leaves(stacked[name])):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])
        for fused, names in FUSED_PROJECTIONS.items():  # columns in q, k, v / gate, up order
            want = np.concatenate([np.asarray(stacked[n]["kernel"])[i] for n in names], axis=-1)
            np.testing.assert_array_equal(np.asarray(layer[fused]["kernel"]), want)
    shapes = unstack_layers(abstract_params(config))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), flat)


def test_fused_projections_grouped_per_shard_split_back_exactly(tiny):
    """`unstack_layers(shards=2)` lays out shard 0's q, k, v columns, then shard 1's;
    `split_fused` recovers the three outputs from the fused product."""
    config, params = tiny
    stacked = params["layers"]
    layer = unstack_layers(params, shards=2)["layer_1"]
    w = np.asarray(layer["qkv_proj"]["kernel"])
    parts = [np.asarray(stacked[n]["kernel"])[1] for n in FUSED_PROJECTIONS["qkv_proj"]]
    halves = [np.split(p, 2, axis=-1) for p in parts]
    want = np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=-1)
    np.testing.assert_array_equal(w, want)
    x = np.random.default_rng(0).standard_normal((3, w.shape[0])).astype(np.float32)
    got = split_fused(jnp.asarray(x @ w), tuple(p.shape[-1] for p in parts), shards=2)
    for g, p in zip(got, parts, strict=True):
        np.testing.assert_allclose(np.asarray(g), x @ p, rtol=1e-5, atol=1e-5)


def test_unstack_layers_drops_the_layer_axis_from_a_named_sharding(tiny):
    """Compile-only params sharded over a mesh: each layer's spec loses its leading entry
    (the stacked spec applied to a layer's rank-2 matrix was an error)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    config, _ = tiny
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh, P(None, *([None] * (x.ndim - 2)), "tp") if x.ndim >= 2 else P())),
        abstract_params(config))
    layer = unstack_layers(params)["layer_0"]
    for leaf in jax.tree.leaves(layer):
        assert len(leaf.sharding.spec) == leaf.ndim and leaf.sharding.spec[-1] == "tp"


def test_layer_loop_choice(monkeypatch):
    monkeypatch.delenv("PAGEDJAX_LAYER_LOOP", raising=False)
    assert resolve_layer_loop(None, 1) == "unrolled"  # one CPU device
    assert resolve_layer_loop(None, 2) == "scan"
    gpu = [types.SimpleNamespace(platform="gpu")]  # any TP: scan copies each layer's weights
    assert resolve_layer_loop(None, 1, gpu) == resolve_layer_loop(None, 4, gpu) == "unrolled"
    assert resolve_layer_loop("scan", 1) == "scan"
    monkeypatch.setenv("PAGEDJAX_LAYER_LOOP", "scan")
    assert resolve_layer_loop(None, 1) == "scan"
    assert resolve_layer_loop("unrolled", 1) == "unrolled"  # the config wins
    monkeypatch.setenv("PAGEDJAX_LAYER_LOOP", "loop")
    with pytest.raises(ValueError, match="PAGEDJAX_LAYER_LOOP"):
        resolve_layer_loop(None, 1)
    with pytest.raises(ValueError, match="layer_loop"):
        EngineConfig(layer_loop="unroll")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_unrolled_equals_reference_under_preemption_and_weight_swap(tiny, mode):
    config, params = tiny
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, rng.integers(3, 40))]
               for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # 12 blocks of 8 slots for six sequences of up to 60 tokens: preemption is forced.
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=12, block_size=8, max_num_seqs=6,
                          preemption_mode=mode, layer_loop="unrolled")
    assert not llm.engine.runner.scan_layers and "layer_0" in llm.engine.runner.params
    out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert out == ReferenceGenerator(config, params).generate(prompts, 20)
    new = jax.tree.map(lambda x: x * 1.05, params)
    llm.update_params(new)
    assert "layer_0" in llm.engine.runner.params
    out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert out == ReferenceGenerator(config, new).generate(prompts, 20)
    assert llm.engine.block_manager.get_num_free_gpu_blocks() == 12


def test_unrolled_demo_model_matches_hf_chat_goldens(demo_model, demo_tokenizer, hf_goldens):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8,
                          layer_loop="unrolled", dtype=jnp.float32)
    cases = hf_goldens["chat"][:3]
    outs = llm.generate([{"prompt_token_ids": c["input_ids"]} for c in cases],
                        SamplingParams(temperature=0, max_tokens=48))
    for out, case in zip(outs, cases):
        assert out.outputs[0].token_ids == case["output_ids"], case["prompt"]

