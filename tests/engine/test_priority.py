"""Priority scheduling in the engine (`scheduling_policy="priority"`, vLLM's): a request of a
lower priority value that arrives while every sequence slot is held by higher values preempts
one of them and runs at once; the preempted request resumes and every request still generates
exactly what it generates alone. With async scheduling on and off, preemption by recompute and
by swap; the block pool is whole afterwards. And the `priority` argument's checks."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

ENGINE = dict(num_gpu_blocks=48, block_size=8, max_num_batched_tokens=64, max_model_len=128,
              swap_space_gb=0.01)


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=7).get)


def _prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(11)
    return {rid: [int(t) for t in rng.integers(3, vocab, int(rng.integers(5, 30)))]
            for rid in ("low1", "low2", "high")}


GREEDY = {"low1": 20, "low2": 20, "high": 6}  # max_tokens


@pytest.fixture(scope="module")
def alone(tiny):
    """Each request's greedy tokens, run on its own."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=2, **ENGINE)
    prompts = _prompts(config.vocab_size)
    return {rid: llm.generate([prompts[rid]], SamplingParams(
        temperature=0.0, max_tokens=GREEDY[rid], ignore_eos=True), use_tqdm=False)[0]
        .outputs[0].token_ids for rid in prompts}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_higher_priority_request_preempts_and_outputs_are_unchanged(tiny, alone,
                                                                       async_scheduling, mode):
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=2, preemption_mode=mode,
                          scheduling_policy="priority", async_scheduling=async_scheduling,
                          **ENGINE)
    engine = llm.engine
    prompts = _prompts(config.vocab_size)

    def add(rid, prio):
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=GREEDY[rid],
                                                     ignore_eos=True),
                           prompt_token_ids=prompts[rid], output_kind="delta", priority=prio)

    tokens: dict[str, list[int]] = {}
    done: list[str] = []

    def step():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done.append(out.request_id)

    add("low1", 5)
    add("low2", 5)
    for _ in range(4):
        step()
    assert len(tokens.get("low2", [])) >= 2  # both low requests are decoding
    add("high", 0)
    step()
    step()  # with async scheduling the first token of a step comes back one step later
    assert tokens.get("high"), "the priority-0 request did not run at once"
    assert engine.scheduler.num_preemptions_total == 1  # low2, the later of the two
    while engine.has_unfinished_requests():
        step()
    assert done.index("high") < done.index("low2")
    for rid, want in alone.items():
        assert tokens[rid] == list(want), rid
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks


def test_priority_is_checked(tiny):
    config, params = tiny
    fcfs = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=2, **ENGINE)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"^priority: 1 needs scheduling_policy='priority'"):
        fcfs.engine.add_request("a", None, sp, prompt_token_ids=[5, 6], priority=1)
    for bad in (True, 1.0, "1", 2**63):
        with pytest.raises(ValueError, match="^priority: "):
            fcfs.engine.add_request("a", None, sp, prompt_token_ids=[5, 6], priority=bad)
    with pytest.raises(ValueError, match="^priority: need one per prompt"):
        fcfs.generate([[5, 6], [7, 8]], sp, priority=[0], use_tqdm=False)
    assert not fcfs.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="priority", kv_policy="static")
    prio = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=1,
                           scheduling_policy="priority", **ENGINE)
    outs = prio.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3),
                         priority=[-(2**63), 2**63 - 1], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
