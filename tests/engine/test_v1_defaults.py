"""vLLM V1's defaults: prefix caching and chunked prefill on for the paged engine, off for the
paper's baselines. A prompt longer than the token budget runs in chunks (and equals the
reference), a repeated prompt hits the cache, and either can be switched off by argument or
flag."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.cli import build_parser, serve_options
from pagedjax.config import EngineConfig
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

ENGINE = dict(num_gpu_blocks=64, block_size=8, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 256})
    return config, assemble_params(config, random_hf_tensors(config, seed=3).get)


def test_config_defaults_follow_the_kv_policy():
    ec = EngineConfig()
    assert ec.enable_prefix_caching is True and ec.enable_chunked_prefill is True
    for policy in ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "static"):
        ec = EngineConfig(kv_policy=policy)
        assert ec.enable_prefix_caching is False and ec.enable_chunked_prefill is False
        with pytest.raises(ValueError, match="^enable_prefix_caching requires kv_policy='paged'"):
            EngineConfig(kv_policy=policy, enable_prefix_caching=True)
    ec = EngineConfig(enable_prefix_caching=False, enable_chunked_prefill=False)
    assert ec.enable_prefix_caching is False and ec.enable_chunked_prefill is False


def test_a_prompt_over_the_budget_runs_in_chunks_and_a_repeat_hits_the_cache(tiny):
    config, params = tiny
    rng = np.random.default_rng(5)
    long = [int(t) for t in rng.integers(3, config.vocab_size, 100)]  # > 32-token budget
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = ReferenceGenerator(config, params).generate([long], 8, ignore_eos=True)[0]

    llm = LLM.from_params(config, params, NoTokenizer(), **ENGINE)
    first = llm.generate([long], sp, use_tqdm=False)[0]
    again = llm.generate([long], sp, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want and again.outputs[0].token_ids == want
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 96  # 12 full blocks of 8; the 100th token is computed
    assert llm.reset_prefix_cache() is True  # as vLLM's: the next run computes it all again
    third = llm.generate([long], sp, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == want
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks

    off = LLM.from_params(config, params, NoTokenizer(), enable_chunked_prefill=False,
                          enable_prefix_caching=False, **ENGINE)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens=32 and chunked "
                                         "prefill is off"):
        off.engine.add_request("long", None, sp, prompt_token_ids=long)
    short = long[:30]
    off.generate([short], sp, use_tqdm=False)
    assert off.generate([short], sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert not off.engine.has_unfinished_requests()
    off.engine.block_manager.check_invariants()
    assert off.engine.block_manager.get_num_free_gpu_blocks() == off.engine.runner.num_gpu_blocks


def test_the_serve_flags_switch_them_off(tmp_path):
    model = str(tmp_path / "m.gguf")  # parsing only: nothing is loaded
    args = build_parser().parse_args(["serve", model, "--max-model-len", "64",
                                      "--no-enable-prefix-caching",
                                      "--no-enable-chunked-prefill"])
    kw = serve_options(args).engine_kwargs
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    ec = EngineConfig(**kw)
    assert ec.enable_prefix_caching is False and ec.enable_chunked_prefill is False
    kw = serve_options(build_parser().parse_args(["serve", model, "--max-model-len", "64"])
                       ).engine_kwargs
    assert "enable_prefix_caching" not in kw and EngineConfig(**kw).enable_prefix_caching
