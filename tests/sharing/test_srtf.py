"""SRTF two-level scheduling end to end: same outputs, short jobs overtake, no starvation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.sharing.helpers import assert_pool_whole, rand_prompt


def _llm(demo_model, demo_tokenizer, policy: str) -> LLM:
    config, params = demo_model
    # One running sequence at a time makes the admission order the finish order.
    return LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=48, block_size=16,
                           max_num_seqs=1, max_num_batched_tokens=128, scheduling_policy=policy)


@pytest.fixture(scope="module")
def srtf(demo_model, demo_tokenizer) -> LLM:
    return _llm(demo_model, demo_tokenizer, "srtf")


def test_srtf_greedy_outputs_equal_reference(demo_model, srtf):
    config, params = demo_model
    rng = np.random.default_rng(3)
    prompts = [rand_prompt(rng, int(rng.integers(3, 50)), config.vocab_size) for _ in range(6)]
    max_tokens = [int(m) for m in rng.integers(2, 10, 6)]
    outs = srtf.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    want = ReferenceGenerator(config, params).generate(prompts, max_tokens, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_pool_whole(srtf)


def _finish_order(llm: LLM, vocab: int) -> list[str]:
    rng = np.random.default_rng(5)
    eng = llm.engine
    eng.add_request("long", None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                    prompt_token_ids=rand_prompt(rng, 60, vocab))
    for i in range(3):
        eng.add_request(f"short{i}", None, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        prompt_token_ids=rand_prompt(rng, 5, vocab))
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    return order


def test_short_requests_overtake_a_long_one(demo_model, demo_tokenizer, srtf):
    config, _ = demo_model
    assert _finish_order(srtf, config.vocab_size) == ["short0", "short1", "short2", "long"]
    assert_pool_whole(srtf)
    fcfs = _llm(demo_model, demo_tokenizer, "fcfs")
    assert _finish_order(fcfs, config.vocab_size) == ["long", "short0", "short1", "short2"]
    assert_pool_whole(fcfs)


def test_no_starvation_under_a_stream_of_short_requests(demo_model, srtf):
    """A new short request arrives every step, yet the long one finishes within a bound:
    staging refills only once empty, so at most one staging batch overtakes it."""
    config, _ = demo_model
    rng = np.random.default_rng(9)
    eng = srtf.engine
    staging = eng.scheduler.config.staging_size
    long_tokens, short_tokens = 6, 2
    eng.add_request("long", None, SamplingParams(temperature=0, max_tokens=long_tokens, ignore_eos=True),
                    prompt_token_ids=rand_prompt(rng, 60, config.vocab_size))
    finished_at, step, i = None, 0, 0
    bound = staging * short_tokens + long_tokens + 2
    while finished_at is None and step <= 10 * bound:
        eng.add_request(f"s{i}", None, SamplingParams(temperature=0, max_tokens=short_tokens,
                                                      ignore_eos=True),
                        prompt_token_ids=rand_prompt(rng, 4, config.vocab_size))
        i += 1
        step += 1
        if any(o.request_id == "long" and o.finished for o in eng.step()):
            finished_at = step
    assert finished_at is not None and finished_at <= bound, (finished_at, bound)
    assert eng.get_num_unfinished_requests() > 0  # shorts were still streaming in
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(srtf)
