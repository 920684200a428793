"""The paper benchmark's replay clock and workloads (pure Python: real scheduler + KV managers)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.paper.replay import CostModel, replay
from bench.paper.trace import make_trace, prompt_ids
from bench.workloads import TRANSLATION_PREFIX

COST = CostModel((0.09, 0.12, 0.005, 0.003, 0.0), {"copy": (1e-3, 1e-4), "swap_out": (1e-3, 2e-4),
                                                    "swap_in": (1e-3, 2e-4)})
KW = dict(num_blocks=64, block_size=8, max_model_len=128, max_num_seqs=32, max_num_batched_tokens=256)


CASES = [(p, s) for p in ("paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max")
         for s in (("single", 1), ("parallel", 3), ("beam", 3))] + [("static", ("single", 1))]


@pytest.mark.parametrize(("policy", "sampling"), CASES)
def test_every_request_finishes_and_pool_is_whole(policy, sampling):
    trace = make_trace("alpaca", 40, 4.0, scale=0.5, max_model_len=128, seed=3)
    res = replay(policy, trace, COST, **KW, sampling=sampling)  # raises if blocks are left held
    assert res["num_finished"] == len(trace)
    assert res["busy_time_s"] > 0 and res["normalized_latency_s_per_token"] > 0


def test_beam_search_copies_far_less_when_paged():
    """Paged beams share blocks and copy only a partial last block; contiguous copies the whole KV."""
    trace = make_trace("alpaca", 30, math.inf, scale=0.5, max_model_len=128, seed=1)
    paged = replay("paged", trace, COST, **KW, sampling=("beam", 4))
    oracle = replay("contiguous-oracle", trace, COST, **KW, sampling=("beam", 4))
    assert 0 < paged["blocks_copied"] < oracle["blocks_copied"] / 2
    assert paged["avg_batched_requests"] > oracle["avg_batched_requests"]


def test_parallel_sampling_batches_more_requests_when_paged():
    trace = make_trace("alpaca", 60, 20.0, scale=0.5, max_model_len=128, seed=2)
    paged = replay("paged", trace, COST, **KW, sampling=("parallel", 4))
    oracle = replay("contiguous-oracle", trace, COST, **KW, sampling=("parallel", 4))
    assert paged["avg_batched_requests"] > oracle["avg_batched_requests"]
    assert paged["normalized_latency_s_per_token"] < oracle["normalized_latency_s_per_token"]


def test_prefix_cache_skips_the_shared_prefix():
    trace = make_trace("translation-5shot", 40, 2.0, scale=0.25, max_model_len=256, seed=4)
    kw = {**KW, "num_blocks": 128, "max_model_len": 256}
    cached = replay("paged", trace, COST, **kw, prefix_caching=True)
    plain = replay("paged", trace, COST, **kw)
    # After the first request, the 85-token prefix (x0.25 of 341) is found cached: 10 full blocks.
    assert cached["busy_time_s"] < plain["busy_time_s"]
    assert cached["num_finished"] == plain["num_finished"] == len(trace)


def test_swap_preemption_moves_blocks_both_ways():
    trace = make_trace("sharegpt", 80, 3.0, scale=0.125, max_model_len=256, seed=5)
    kw = {**KW, "num_blocks": 48, "max_model_len": 256}
    swap = replay("paged", trace, COST, **kw, preemption_mode="swap", num_cpu_blocks=192)
    recompute = replay("paged", trace, COST, **kw)
    assert swap["preemptions"] > 0 and recompute["preemptions"] > 0
    assert swap["blocks_swapped_out"] == swap["blocks_swapped_in"] > 0
    assert recompute["blocks_swapped_out"] == 0


def test_translation_prompts_share_exactly_the_prefix():
    trace = make_trace("translation-1shot", 20, math.inf, scale=1.0, max_model_len=512, seed=6)
    assert {r.prefix_len for r in trace} == {TRANSLATION_PREFIX["translation-1shot"]}
    ids = [prompt_ids(r, 49152) for r in trace]
    assert all(len(x) == r.prompt_len for x, r in zip(ids, trace))
    assert all(x[:80] == ids[0][:80] for x in ids)
    assert len({tuple(x[80:]) for x in ids}) == len(ids)  # the sentences differ


def test_chatbot_prompts_are_cut_and_mostly_full():
    trace = make_trace("chatbot", 500, math.inf, scale=0.125, max_model_len=256, seed=7)
    lens = np.array([r.prompt_len for r in trace])
    outs = np.array([r.output_len for r in trace])
    assert lens.max() == 128 and (lens == 128).mean() > 0.5  # "most requests have 1024 tokens"
    assert outs.max() <= 128 and (lens + outs).max() <= 255


def test_a_short_trace_does_not_hide_overload():
    """On a fast device a few short requests all fit in one batch, so past capacity the
    normalized latency of a fixed-size trace stays flat and the sweep never finds the
    sustainable rate (the first H200 run: Alpaca-like 'sustainable' at 3445 req/s). Arrivals
    spanning a minimum time bring the overload out."""
    from bench.paper.figures import Panel, requests_at, sweep_panel

    fast = CostModel((0.0077, 0.0062, 7.7e-06, 0.0, 5.6e-07))
    panel = Panel("t", "alpaca", 0.125, {"paged": ("paged", {})})
    cfg = {"max_model_len": KW["max_model_len"]}
    short = sweep_panel(panel, {**cfg, "min_trace_span_s": 0.0}, fast, KW, 24)["systems"]["paged"]
    assert not short["bounded"] and short["sustainable_rate"] == short["rates"][-1]
    assert set(short["requests"]) == {24}
    long = sweep_panel(panel, {**cfg, "min_trace_span_s": 20.0}, fast, KW, 24)["systems"]["paged"]
    assert long["bounded"] and long["sustainable_rate"] < long["rates"][-1]
    assert long["sustainable_rate"] < short["sustainable_rate"] / 4
    assert requests_at(10.0, 24, {"min_trace_span_s": 20.0}) == 200
    assert requests_at(100.0, 24, {"min_trace_span_s": 20.0}) == 40 * 24  # capped
    assert requests_at(0.5, 24, {"min_trace_span_s": 20.0}) == 24
