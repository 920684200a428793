"""Hybrid KV-cache groups end to end (Gemma 2/3 and a Qwen2 config mixing global and
windowed layers, from the HF family goldens, window 8).

Each group has its own block tables; local groups release blocks behind their window and
any group of any request reuses them at once (small pools). The cache starts poisoned (every
slot a large value), so a read of a slot the tables do not name for that position changes
tokens. Outputs must equal the reference generator's (contiguous cache, no paging) under
recompute and swap preemption with prefix caching on, and the one-table engine's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.loader import load_model
from pagedjax import LLM, SamplingParams
from pagedjax.core.block_manager import NULL_BLOCK
from pagedjax.core.hybrid_kv_manager import HybridBlockManager
from pagedjax.reference import ReferenceGenerator
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.model.test_families import write_family
from tests.parallel.tp_script import NoTokenizer

HYBRID = ["gemma2", "gemma3", "qwen2-window"]


@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_family(request.param, path)
    config, params, _ = load_model(path, dtype="float32")
    assert 0 in config.windows and any(config.windows)
    return request.param, config, params


def _poison(llm: LLM, value: float = 1e3) -> None:
    r = llm.engine.runner
    r.k_cache = jnp.full_like(r.k_cache, value)
    r.v_cache = jnp.full_like(r.v_cache, -value)


def _workload(config, seed: int, n: int = 10):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, config.vocab_size, 20)]
    prompts = [shared[: int(rng.integers(5, 21))] + [int(t) for t in rng.integers(3, 128, int(k))]
               for k in rng.integers(1, 30, n)]
    max_tokens = [int(m) for m in rng.integers(20, 60, n)]
    return prompts, max_tokens


def _run(llm: LLM, prompts, max_tokens):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                         for m in max_tokens])
    return [o.outputs[0].token_ids for o in outs]


def test_engine_builds_groups_and_a_smaller_block(hybrid):
    _, config, params = hybrid
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_model_len=128)
    r, bm = llm.engine.runner, llm.engine.block_manager
    lay = r.kv_layout
    assert isinstance(bm, HybridBlockManager) and bm.group_windows == lay.group_windows
    assert r.k_cache.shape[0] == lay.num_slots < config.num_layers
    assert set(lay.group_windows) == set(config.windows)
    one = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_model_len=128, disable_hybrid_kv_cache_manager=True)
    assert one.engine.runner.k_cache.shape[0] == config.num_layers
    assert not isinstance(one.engine.block_manager, HybridBlockManager)


def test_local_groups_hold_one_window_global_holds_all(hybrid):
    _, config, params = hybrid
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_model_len=128)
    eng, bm = llm.engine, llm.engine.block_manager
    eng.add_request("long", None, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
                    prompt_token_ids=list(range(3, 43)))
    while eng.has_unfinished_requests():
        eng.step()
        for g in eng.scheduler.running:
            seq = g.seqs[0]
            done = seq.num_computed_tokens
            for w, table in zip(bm.group_windows, bm.get_block_table(seq), strict=True):
                if not w:
                    assert NULL_BLOCK not in table and len(table) * 8 >= done
                    continue
                assert all(table[p // 8] != NULL_BLOCK for p in range(max(0, done - w), done))
                if done > 48:  # a window of 8 spans at most 2 blocks, plus the one being filled
                    assert sum(b != NULL_BLOCK for b in table) <= 3
    assert_pool_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_reused_blocks_and_poison_never_read(hybrid, mode):
    name, config, params = hybrid
    prompts, max_tokens = _workload(config, 3)
    want = ReferenceGenerator(config, params).generate(prompts, max_tokens, eos_token_ids=())
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                          max_num_seqs=6, max_model_len=128, preemption_mode=mode,
                          enable_prefix_caching=True, max_num_batched_tokens=16,
                          enable_chunked_prefill=True)
    _poison(llm)
    assert _run(llm, prompts, max_tokens) == want, name
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_total > 0, name  # the pool is too small for six at once
    assert_pool_whole(llm)
    # Again with the cache left as the first run wrote it: prefix hits on stale KV.
    assert _run(llm, prompts, max_tokens) == want, name
    assert_pool_whole(llm)


def test_hybrid_holds_less_than_one_table(hybrid):
    """Same outputs as the one-table engine; peak KV memory (in layer-blocks: block ids
    times the layers each holds) is lower once sequences outgrow the window."""
    name, config, params = hybrid
    prompts, max_tokens = _workload(config, 5, n=4)

    def peak(disable: bool):
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=400, block_size=8,
                              max_num_seqs=4, max_model_len=128,
                              disable_hybrid_kv_cache_manager=disable)
        eng = llm.engine
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            eng.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=m,
                                                         ignore_eos=True), prompt_token_ids=p)
        used, outs = 0, {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            held = eng.runner.num_gpu_blocks - eng.block_manager.get_num_free_gpu_blocks()
            used = max(used, held * eng.runner.kv_layout.num_slots)
        assert_pool_whole(llm)
        return used, [outs[str(i)] for i in range(len(prompts))]

    hybrid_peak, hybrid_out = peak(False)
    single_peak, single_out = peak(True)
    assert hybrid_out == single_out, name
    assert hybrid_peak < single_peak, (name, hybrid_peak, single_peak)
