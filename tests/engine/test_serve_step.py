"""The step as serving calls it (`ModelRunner._make_serve_step`): the weights as one flat tuple,
the step's host int32 arrays packed into one buffer, pending token ids merged in the call.
It must compute exactly what the plain step (`ModelRunner._step`, params dict, arrays one by
one, ids merged beforehand) computes: logits and both caches, bit for bit, on a mixed step
over a cache of random values, for both layer loops; and a weight swap of the same structure keeps
the compiled serving step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.worker.step_inputs import build_step_inputs
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def _llm(tiny, layer_loop: str) -> LLM:
    config, params = tiny
    return LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                           max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                           layer_loop=layer_loop)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_serve_step_is_the_plain_step(tiny, layer_loop):
    config, _ = tiny
    runner = _llm(tiny, layer_loop).engine.runner
    rng = np.random.default_rng(0)
    # Random values in every block: the decodes attend over cached context, and both forms
    # must read the same slots of it (a misplaced table or length reads other values).
    k0 = rng.standard_normal(runner.k_cache.shape).astype(runner.k_cache.dtype)
    v0 = rng.standard_normal(runner.v_cache.shape).astype(runner.v_cache.dtype)
    vocab = config.vocab_size
    seqs = [  # a 13-token prefill chunk, two decodes over cached context
        ScheduledSeq(0, "a", [int(t) for t in rng.integers(3, vocab, 13)], 0, [1, 2], True),
        ScheduledSeq(1, "b", [int(rng.integers(3, vocab))], 20, [5, 6, 7], True),
        ScheduledSeq(2, "c", [int(rng.integers(3, vocab))], 9, [9, 3], True),
    ]
    inputs = build_step_inputs(seqs, runner.block_size, runner.max_blocks_per_seq,
                               plan=runner.shape_plan)
    # Async scheduling: the two decode tokens are pending, their ids on the device.
    prev_tokens = jax.device_put(rng.integers(3, vocab, runner.shape_plan.sample_cap)
                                 .astype(np.int32), jax.local_devices()[0])
    prev_rows = np.full(inputs.input_ids.shape, -1, np.int32)
    prev_rows[13], prev_rows[14] = 4, 1
    inputs.prev_rows, inputs.prev_tokens = prev_rows, prev_tokens
    merged = inputs.input_ids.copy()
    merged[13], merged[14] = np.asarray(prev_tokens)[[4, 1]]

    args = runner._step_args(inputs)
    host = [a for a in jax.tree.leaves(args[3:6]) if isinstance(a, np.ndarray)]
    assert len(host) == 1 and host[0].dtype == np.int32  # one transfer for the step's ints

    dev = jax.local_devices()[0]
    runner.k_cache, runner.v_cache = jax.device_put(k0, dev), jax.device_put(v0, dev)
    got, k_got, v_got = runner._serve_step(*runner._step_args(inputs))
    ref, k_ref, v_ref = type(runner)._step(
        runner, runner.params, jax.device_put(k0, dev), jax.device_put(v0, dev), merged,
        inputs.positions, runner.step_meta(inputs.meta), inputs.logits_indices)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(k_got), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_ref))
    # The merge took the pending ids: the decode rows differ from the host ids' step.
    runner.k_cache, runner.v_cache = jax.device_put(k0, dev), jax.device_put(v0, dev)
    inputs.prev_rows = inputs.prev_tokens = None
    unmerged, runner.k_cache, runner.v_cache = runner._serve_step(*runner._step_args(inputs))
    assert not np.array_equal(np.asarray(unmerged)[1:3], np.asarray(got)[1:3])
    np.testing.assert_array_equal(np.asarray(unmerged)[0], np.asarray(got)[0])


def test_weight_swap_keeps_the_serving_step(tiny):
    config, params = tiny
    llm = _llm(tiny, "unrolled")
    runner = llm.engine.runner
    step = runner._serve_step
    new = jax.tree.map(lambda x: x * 1.5 if x.dtype == np.float32 else x, runner.params)
    runner.params = new
    assert runner._serve_step is step  # same structure: the compiled steps still apply
    assert all(a is b for a, b in zip(runner._flat_params, jax.tree.leaves(new), strict=True))
    changed = {**new, "extra": jax.numpy.zeros(3)}
    runner.params = changed
    assert runner._serve_step is not step  # another structure: another step
    runner.params = new
