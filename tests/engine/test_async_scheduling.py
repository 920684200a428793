"""Asynchronous scheduling (thesis §4.6.1): the engine schedules and launches step N+1 before
it has collected step N's tokens, whose ids reach the device straight from the sampler.
The outputs must be exactly those of the synchronous engine, whatever the workload does:
preemption by swap and by recompute, prefix-cache hits, chunked prefill, n > 1 and best_of,
beams, penalties, logprobs, prompt logprobs, stop strings and ids that end a sequence one step
after the next step was launched, and aborts while a step is on the device."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=11).get)


def _params(rng: np.random.Generator, prefix_caching: bool) -> SamplingParams:
    kind = int(rng.integers(0, 8))
    m = int(rng.integers(1, 28))
    if kind == 0:  # plain greedy: the sequences async scheduling runs ahead for
        return SamplingParams(temperature=0, max_tokens=m, ignore_eos=bool(rng.integers(0, 2)))
    if kind == 1:  # seeded sampling: the row's random stream counts pending tokens
        return SamplingParams(temperature=0.9, top_p=0.9, top_k=int(rng.integers(1, 40)),
                              seed=int(rng.integers(0, 1000)), max_tokens=m,
                              logprobs=int(rng.integers(0, 6)), min_tokens=min(4, m))
    if kind == 2:  # penalties: the pending token reaches the history on the device
        return SamplingParams(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.2,
                              seed=int(rng.integers(0, 1000)), max_tokens=m)
    if kind == 3:  # beams: forks decided on the host
        return SamplingParams(use_beam_search=True, best_of=int(rng.integers(2, 4)),
                              temperature=0, max_tokens=m, ignore_eos=True)
    if kind == 4:  # fan-out, then independent samples
        return SamplingParams(temperature=1.0, n=2, best_of=int(rng.integers(2, 4)),
                              seed=int(rng.integers(0, 1000)), max_tokens=m)
    if kind == 5:  # stop ids and strings: found after the next step was launched
        return SamplingParams(temperature=0, max_tokens=m,
                              stop_token_ids=[int(t) for t in rng.integers(3, 90, 6)],
                              stop=["1 2", "7"])
    if kind == 6 and not prefix_caching:
        return SamplingParams(temperature=0, max_tokens=m, prompt_logprobs=3, logprobs=2)
    return SamplingParams(temperature=0.7, seed=int(rng.integers(0, 1000)), max_tokens=m,
                          stop_token_ids=[int(t) for t in rng.integers(3, 90, 4)])


def _run(config, params, async_scheduling: bool, mode: str, prefix_caching: bool, seed: int):
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=28, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, enable_prefix_caching=prefix_caching,
                          enable_chunked_prefill=True, swap_space_gb=0.01,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    fed = []
    execute = engine.runner.execute

    def spy(inputs):
        fed.append(0 if inputs.prev_rows is None else int((inputs.prev_rows >= 0).sum()))
        return execute(inputs)

    engine.runner.execute = spy
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, config.vocab_size, 24)]
    requests = []
    for i in range(48):
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(1, 60)))]
        if i % 3 == 0:
            prompt = shared + prompt[:30]
        requests.append((f"r{i}", prompt, _params(rng, prefix_caching)))
    # Arrivals and aborts are tied to step calls, so both engines see the same sequence.
    plan = np.random.default_rng(seed + 1)
    outputs, pending, calls, aborted = {}, list(requests), 0, set()
    while pending or engine.has_unfinished_requests():
        for _ in range(int(plan.integers(0, 4))):
            if pending:
                rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, None, sp, prompt_token_ids=prompt)
        if calls % 9 == 4:
            rid = f"r{int(plan.integers(0, 48))}"
            if rid not in outputs:
                aborted.add(rid)
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        calls += 1
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    assert engine._inflight is None
    return outputs, aborted, fed, engine.get_stats()


def _key(out):
    """Everything exact but logprob values, which carry float noise from batch composition
    (the two engines batch differently); those are compared to 1e-4 in `_logprobs`."""
    return [(c.index, c.token_ids, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted(d) for d in c.logprobs],
             c.cumulative_logprob is None)
            for c in out.outputs], [d and sorted(d) for d in out.prompt_logprobs or []], out.error


def _logprobs(out) -> np.ndarray:
    vals = [v for c in out.outputs for d in c.logprobs or [] for _, v in sorted(d.items())]
    vals += [v for d in out.prompt_logprobs or [] if d for _, v in sorted(d.items())]
    vals += [c.cumulative_logprob for c in out.outputs if c.cumulative_logprob is not None]
    return np.asarray(vals, np.float64)


@pytest.mark.parametrize("mode,prefix_caching,seed", [("swap", True, 0), ("recompute", False, 1),
                                                      ("recompute", True, 2)])
def test_async_outputs_equal_sync(tiny, mode, prefix_caching, seed):
    config, params = tiny
    sync, ab_sync, fed_sync, st_sync = _run(config, params, False, mode, prefix_caching, seed)
    asy, ab_async, fed_async, st_async = _run(config, params, True, mode, prefix_caching, seed)
    assert not any(fed_sync), "the synchronous engine never takes ids from the device"
    assert sum(1 for f in fed_async if f) > len(fed_async) // 4, \
        "async scheduling should feed pending tokens on many steps"
    assert st_sync.num_preemptions_total > 0 and st_async.num_preemptions_total > 0
    assert set(sync) == set(asy)
    # An abort lands at the same call in both runs, but the async engine has applied one step
    # less by then: aborted requests may differ; all others must be identical.
    same = [rid for rid in sync if rid not in ab_sync | ab_async]
    assert len(same) > 30
    for rid in same:
        assert _key(asy[rid]) == _key(sync[rid]), rid
        np.testing.assert_allclose(_logprobs(asy[rid]), _logprobs(sync[rid]), atol=1e-4)
    for rid in ab_sync | ab_async:
        if rid in asy and asy[rid].outputs and asy[rid].outputs[0].finish_reason == "abort":
            assert rid in ab_async


def test_async_greedy_equals_reference_with_eos(tiny):
    """Plain greedy requests (EOS honoured, so some stop a step after the next one was
    launched) equal the reference generator with async scheduling on."""
    config, params = tiny
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(2, 40)))]
               for _ in range(12)]
    max_tokens = [int(m) for m in rng.integers(3, 40, len(prompts))]
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_num_seqs=4, max_model_len=128, async_scheduling=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    eos = list(config.eos_token_ids)
    want = ReferenceGenerator(config, params).generate(prompts, max_tokens, eos_token_ids=eos)
    for out, w in zip(outs, want):
        assert out.outputs[0].token_ids == w
    bm = llm.engine.block_manager
    assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks


def test_async_step_runs_ahead(tiny):
    """The step returns with the next step launched; its outputs come one call later."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, max_model_len=128, async_scheduling=True)
    eng = llm.engine
    eng.add_request("a", None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                    prompt_token_ids=[5, 6, 7, 8])
    assert eng.step() == []  # prefill launched, nothing collected yet
    assert eng._inflight is not None
    seq = eng._requests["a"].group.seqs[0]
    assert seq.num_pending == 1 and seq.num_output_tokens == 0
    outs = eng.step()  # first decode launched, the prefill's token collected
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    n = 1
    while eng.has_unfinished_requests():
        for o in eng.step():
            n = len(o.outputs[0].token_ids)
    assert n == 5
    assert eng._inflight is None
    assert eng.block_manager.get_num_free_gpu_blocks() == eng.runner.num_gpu_blocks


def test_async_scheduling_refused_with_tensor_parallelism():
    from pagedjax.worker.model_runner import resolve_async_scheduling

    with pytest.raises(ValueError, match="async_scheduling"):
        resolve_async_scheduling(True, 2)
    assert resolve_async_scheduling(None, 2) is False
    assert resolve_async_scheduling(False, 1) is False
    assert resolve_async_scheduling(None, 1) is True  # the default with one device, CPU too


def test_penalised_requests_run_ahead_and_equal_sync(tiny):
    """Penalties no longer force a host sync: the pending token is written into the
    sampler's history on the device (`ModelRunner.merge_pending_history`). Every request
    penalised, sampled and seeded: async runs ahead on most steps and draws exactly the
    tokens of the synchronous engine (a history missing the pending token changes them)."""
    config, params = tiny
    runs = {}
    for async_on in (False, True):
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                              max_num_seqs=8, max_model_len=128, async_scheduling=async_on)
        fed = []
        execute = llm.engine.runner.execute

        def spy(inputs, execute=execute, fed=fed):
            fed.append(0 if inputs.prev_rows is None else int((inputs.prev_rows >= 0).sum()))
            return execute(inputs)

        llm.engine.runner.execute = spy
        rng = np.random.default_rng(5)
        prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 40, int(n))]}
                   for n in rng.integers(2, 20, 6)]
        sps = [SamplingParams(temperature=1.5, frequency_penalty=float(f), presence_penalty=0.7,
                              repetition_penalty=1.3, seed=i, max_tokens=40, ignore_eos=True)
               for i, f in enumerate(rng.uniform(0.5, 2.0, 6))]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        runs[async_on] = ([o.outputs[0].token_ids for o in outs], fed)
        bm = llm.engine.block_manager
        assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks
    assert runs[True][0] == runs[False][0]
    fed = runs[True][1]
    assert sum(1 for f in fed if f) > 0.6 * len(fed), fed
