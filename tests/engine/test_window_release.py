"""Window-aware block release end to end: a model whose every layer is windowed (the Mistral
family config of the HF goldens, window 8) releases blocks behind the window while it runs,
other requests reuse them at once (a small pool), and every output still equals the
reference generator's (contiguous cache, windowed attention). A wrong read of a released,
reused block would change tokens; a leak would show in the pool at the end."""

from __future__ import annotations

import numpy as np
import pytest

from models.loader import load_model
from pagedjax import LLM, SamplingParams
from pagedjax.core.block_manager import NULL_BLOCK
from pagedjax.reference import ReferenceGenerator
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.model.test_families import write_family
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    write_family("mistral", path)
    config, params, _ = load_model(path, dtype="float32")
    assert config.max_window == 8
    return config, params


def test_decode_holds_one_window_of_blocks(windowed):
    config, params = windowed
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_model_len=128)
    eng, bm = llm.engine, llm.engine.block_manager
    assert bm.sliding_window == 8
    eng.add_request("long", None, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
                    prompt_token_ids=list(range(3, 43)))
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        for g in eng.scheduler.running:
            seq = g.seqs[0]
            held.append(bm.num_held_blocks(seq))
            table = bm.get_block_table(seq)
            done = seq.num_computed_tokens  # the last computed token's window is still held
            assert all(table[p // 8] != NULL_BLOCK for p in range(max(0, done - 8), done))
    # 120 tokens would need 15 blocks; within an 8-token window a decode holds at most 3.
    assert max(held[-40:]) <= 3
    assert held[0] >= 5  # the 40-token prompt arrives whole
    assert_pool_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_released_blocks_are_reused_without_wrong_reads(windowed, mode):
    config, params = windowed
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, config.vocab_size, 20)]
    prompts = [shared[: int(rng.integers(5, 21))] + [int(t) for t in rng.integers(3, 128, int(k))]
               for k in rng.integers(1, 30, 10)]
    max_tokens = [int(m) for m in rng.integers(20, 60, len(prompts))]
    want = ReferenceGenerator(config, params).generate(prompts, max_tokens, eos_token_ids=())
    # 16 blocks of 8 slots for up to 6 sequences of up to 89 tokens: without release the
    # pool could not hold two long sequences; with it, blocks cycle between requests.
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=24, block_size=8,
                          max_num_seqs=6, max_model_len=128, preemption_mode=mode,
                          enable_prefix_caching=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params_list = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(reqs, params_list)
    for out, w in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == w
    assert_pool_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_windowed_preemption_recompute_and_swap(windowed, mode):
    """A window wider than the pool can hold for every sequence (32 tokens = 4-5 blocks each,
    6 sequences, 16 blocks): sequences are preempted mid-window, swapped out and back with
    released slots in their tables, or recomputed, and still equal the reference."""
    import dataclasses

    config, params = windowed
    config = dataclasses.replace(config, layer_windows=(32,) * config.num_layers)
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, 128, int(k))] for k in rng.integers(5, 30, 6)]
    max_tokens = [int(m) for m in rng.integers(30, 60, len(prompts))]
    want = ReferenceGenerator(config, params).generate(prompts, max_tokens, eos_token_ids=())
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                          max_num_seqs=6, max_model_len=128, preemption_mode=mode)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                         for m in max_tokens])
    for out, w in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == w
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert_pool_whole(llm)


def test_parallel_samples_share_and_release(windowed):
    """n > 1 forks share the prompt's blocks; each child releases its own references."""
    config, params = windowed
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                          max_model_len=128)
    sp = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=50, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(3, 30))}], sp)[0]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 50 for o in out.outputs)
    again = llm.generate([{"prompt_token_ids": list(range(3, 30))}], sp)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert_pool_whole(llm)
