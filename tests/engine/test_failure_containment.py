"""Failure containment inside a step (issue 16): a failed step fails only what it concerns,
and a lost device KV cache is rebuilt so the engine keeps serving."""

from __future__ import annotations

import pytest

from models.config import LlamaConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = LlamaConfig.from_hf(TINY_HF_CONFIG)
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def test_lost_kv_cache_is_rebuilt_and_serving_goes_on(tiny):
    """A step that fails after its donated cache was consumed (deleted buffers) would fail every
    later step; the engine fails the requests that held KV, allocates a fresh cache, and keeps
    serving: later requests equal the reference and the pool is whole."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, layer_loop="scan")
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", None, sp, prompt_token_ids=[5, 6, 7])
    eng.step()  # "a" now holds KV
    real = eng.runner.execute

    def explode(inputs):
        eng.runner.k_cache.delete()  # what a device failure after donation leaves behind
        raise RuntimeError("device fell over")

    eng.runner.execute = explode
    eng.add_request("b", None, sp, prompt_token_ids=[8, 9])
    outs = {o.request_id: o for o in eng.step()}
    assert "device fell over" in outs["a"].error and outs["a"].finished
    assert eng.get_stats().num_cache_rebuilds == 1 and not eng.runner.cache_lost()
    eng.runner.execute = real
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == ReferenceGenerator(config, params).generate(prompts, 6)
    assert eng.block_manager.get_num_free_gpu_blocks() == 32
