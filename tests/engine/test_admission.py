"""Admission control for growth (issue 16): a request whose samples could outgrow the whole KV
cache is refused up front by the servers (`strict_limits`), and one that outgrows it anyway
ends with finish_reason "length" and what it generated, never an error with its output lost."""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

BLOCKS, BS, MAX_LEN = 32, 8, 128


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    return config, assemble_params(config, random_hf_tensors(config, seed=11).get)


def _llm(tiny, blocks=BLOCKS, **kw):
    config, params = tiny
    kw = {"num_gpu_blocks": blocks, "block_size": BS, "max_model_len": MAX_LEN, "max_num_seqs": 8,
          "layer_loop": "scan", **kw}
    return LLM.from_params(config, params, NoTokenizer(), **kw)


def test_strict_limits_name_max_tokens(tiny):
    eng = _llm(tiny).engine
    sp = SamplingParams(max_tokens=MAX_LEN, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^max_tokens: prompt \(3 tokens\) \+ max_tokens \(128\) "
                                         r"exceeds max_model_len=128; at most 125"):
        eng.add_request("long", None, sp, prompt_token_ids=[1, 2, 3], strict_limits=True)
    many = SamplingParams(n=4, max_tokens=100, temperature=1.0, seed=1, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^max_tokens: 4 sequences .* could need \d+ KV blocks, "
                                         r"the cache holds 32; .* or n/best_of"):
        eng.add_request("wide", None, many, prompt_token_ids=[1, 2, 3], strict_limits=True)
    beams = SamplingParams(best_of=4, use_beam_search=True, temperature=0, max_tokens=100)
    with pytest.raises(ValueError, match=r"^max_tokens: 4 sequences"):
        eng.add_request("beams", None, beams, prompt_token_ids=[1, 2, 3], strict_limits=True)
    assert not eng.has_unfinished_requests()
    # The Python API keeps vLLM's offline semantics: accepted, capped where it runs out.
    eng.add_request("capped", None, SamplingParams(max_tokens=MAX_LEN, ignore_eos=True),
                    prompt_token_ids=[1, 2, 3])
    eng.abort_request("capped")
    eng.step()
    assert eng.block_manager.get_num_free_gpu_blocks() == BLOCKS


@pytest.mark.parametrize("samples,prompt_len", [(1, 3), (4, 3), (4, 17), (3, 40)])
def test_max_output_tokens_is_the_largest_that_fits_and_it_really_fits(tiny, samples, prompt_len):
    """`max_output_tokens` is the boundary of `check_growth`, and a request at that boundary,
    its samples all growing to the end, runs to completion within the bound (brute force:
    the blocks it held at its peak, measured)."""
    eng = _llm(tiny).engine
    m = eng.max_output_tokens(prompt_len, samples)
    assert m >= 1
    eng.check_growth(prompt_len, m, samples)
    if prompt_len + m < MAX_LEN:
        with pytest.raises(ValueError, match="^max_tokens"):
            eng.check_growth(prompt_len, m + 1, samples)
    sp = SamplingParams(n=samples, max_tokens=m, temperature=1.0, seed=3, ignore_eos=True)
    prompt = [(7 * i) % 50 + 1 for i in range(prompt_len)]
    eng.add_request("r", None, sp, prompt_token_ids=prompt, strict_limits=True)
    outs = []
    peak = 0
    while eng.has_unfinished_requests():
        outs += eng.step()
        peak = max(peak, BLOCKS - eng.block_manager.get_num_free_gpu_blocks())
    final = [o for o in outs if o.finished][-1]
    assert final.error is None
    assert [len(c.token_ids) for c in final.outputs] == [m] * samples
    assert all(c.finish_reason == "length" for c in final.outputs)
    assert peak <= eng.block_manager.worst_case_blocks(prompt_len, prompt_len + m, samples)
    assert eng.get_stats().num_preemptions_total == 0  # alone, it never ran out
    assert eng.block_manager.get_num_free_gpu_blocks() == BLOCKS


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_request_that_outgrows_the_cache_ends_with_length_and_its_tokens(tiny, mode):
    """Four samples that together outgrow the pool (admitted without strict limits) end with
    "length": each output is a prefix of the same sample run on a pool large enough."""
    sp = SamplingParams(n=4, max_tokens=100, temperature=1.0, seed=7, ignore_eos=True)
    big = _llm(tiny, blocks=256).engine
    big.add_request("r", None, sp, prompt_token_ids=[4, 5, 6])
    ref = None
    while big.has_unfinished_requests():
        for o in big.step():
            if o.finished:
                ref = {c.index: c.token_ids for c in o.outputs}
    assert all(len(t) == 100 for t in ref.values())

    # Without CPU room even a multi-sample group (normally swapped) is recomputed.
    eng = _llm(tiny, preemption_mode=mode, swap_space_gb=0.25 if mode == "swap" else 0).engine
    eng.add_request("r", None, sp, prompt_token_ids=[4, 5, 6])
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final = o
    assert final.error is None, final.error
    assert all(c.finish_reason == "length" for c in final.outputs)
    got = {c.index: c.token_ids for c in final.outputs}
    assert sorted(got) == [0, 1, 2, 3]
    for i, toks in got.items():
        assert 0 < len(toks) < 100 and toks == ref[i][: len(toks)]
    assert eng.block_manager.get_num_free_gpu_blocks() == BLOCKS


def test_replaced_kv_manager_and_scheduler_reach_admission_and_beams(tiny):
    """bench/paper swaps the KV policy of an idle engine: growth checks and beam forks must use
    the new block manager and scheduler, not the ones the engine started with."""
    from bench.paper.engine_setup import set_policy

    eng = _llm(tiny).engine
    set_policy(eng, "paged", prefix_caching=True, preemption_mode="swap")
    assert eng.inputs.block_manager is eng.block_manager
    assert eng.beams.scheduler is eng.scheduler
    sp = SamplingParams(best_of=2, use_beam_search=True, temperature=0, max_tokens=4,
                        ignore_eos=True)
    eng.add_request("b", None, sp, prompt_token_ids=[1, 2, 3], strict_limits=True)
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[-1].finished and outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 4
    assert eng.block_manager.get_num_free_gpu_blocks() == BLOCKS


def test_a_withdrawn_request_leaves_no_output_and_frees_its_blocks(tiny):
    """`abort_request(withdraw=True)`: what the servers do with the prompts already added of a
    request whose later prompt was refused. No abort output follows, so a new request under
    the same id (the client may retry at once) never receives the old one's end."""
    eng = _llm(tiny).engine
    free = eng.block_manager.get_num_free_gpu_blocks()
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    eng.add_request("a", None, sp, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    eng.add_request("b", None, sp, prompt_token_ids=[4, 5, 6])
    eng.step()
    eng.abort_request("a", withdraw=True)
    eng.add_request("a", None, sp, prompt_token_ids=[7, 8])  # the id, reused before a step
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert sorted(finals) == ["a", "b"] and len([o for o in outs if o.request_id == "a"
                                                 and o.finished]) == 1
    assert finals["a"].prompt_token_ids == [7, 8]
    assert finals["a"].outputs[0].finish_reason == "length"
    assert len(finals["a"].outputs[0].token_ids) == 6
    assert eng.block_manager.get_num_free_gpu_blocks() == free
