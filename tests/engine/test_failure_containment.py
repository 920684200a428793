"""Failure containment inside a step (issue 16): a failed step fails only what it concerns,
and a lost device KV cache is rebuilt so the engine keeps serving."""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
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


def _run(eng) -> dict:
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_scheduling_failure_fails_only_its_request(tiny):
    """An exception while scheduling one request (here: its block allocation at admission, and
    later another's block growth, once it holds blocks and has generated tokens) fails that
    request alone with a clear error; the others finish equal to the reference, and the pool
    is whole."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, layer_loop="scan")
    eng = llm.engine
    bm = eng.block_manager
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    real_allocate, real_append, real_slot = bm.allocate, bm.append_slots, bm.decode_slot

    def allocate(group):
        if group.request_id == "bad-admit":
            raise RuntimeError("allocator bug")
        return real_allocate(group)

    def append_slots(seq, n):
        if seq.seq_id == victim_seq and seq.num_computed_tokens >= 8:
            raise RuntimeError("append bug")
        return real_append(seq, n)

    def decode_slot(seq):  # the scheduler's decode fast path grows blocks here
        if seq.seq_id == victim_seq and seq.num_computed_tokens >= 8:
            raise RuntimeError("append bug")
        return real_slot(seq)

    bm.allocate, bm.append_slots, bm.decode_slot = allocate, append_slots, decode_slot
    prompts = {"a": [5, 6, 7], "bad-admit": [1, 2], "bad-grow": [9, 8, 7, 6], "b": [3, 4, 5, 6, 7]}
    for rid, p in prompts.items():
        eng.add_request(rid, None, sp, prompt_token_ids=p)
    victim_seq = eng._requests["bad-grow"].group.seqs[0].seq_id
    outs = _run(eng)
    assert "internal error while scheduling: RuntimeError: allocator bug" in outs["bad-admit"].error
    assert "append bug" in outs["bad-grow"].error
    assert outs["bad-grow"].outputs[0].token_ids  # it had started
    ref = ReferenceGenerator(config, params).generate([prompts["a"], prompts["b"]], 12)
    assert [outs["a"].outputs[0].token_ids, outs["b"].outputs[0].token_ids] == ref
    assert outs["a"].error is None and outs["b"].error is None
    assert eng.get_stats().num_step_failures == 2
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 32


def test_lost_cache_that_cannot_be_rebuilt_yet_reports_unhealthy_until_it_is(tiny, monkeypatch):
    """If reallocating the cache fails too (the device is still out of memory), the engine
    reports itself unhealthy, schedules nothing, retries every step, and once the cache is
    back serves the waiting request correctly."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, layer_loop="scan")
    eng = llm.engine
    monkeypatch.setattr(eng, "CACHE_RETRY_S", 0.0)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", None, sp, prompt_token_ids=[5, 6, 7])
    eng.step()
    real_execute, real_reset = eng.runner.execute, eng.runner.reset_cache
    fails = {"n": 2}

    def explode(inputs):
        eng.runner.k_cache.delete()
        raise RuntimeError("device fell over")

    def reset():
        if fails["n"]:
            fails["n"] -= 1
            raise RuntimeError("out of device memory")
        real_reset()

    eng.runner.execute, eng.runner.reset_cache = explode, reset
    outs = {o.request_id: o for o in eng.step()}
    assert "device fell over" in outs["a"].error
    assert not eng.healthy and not eng.get_stats().healthy
    eng.runner.execute = real_execute
    eng.add_request("b", None, sp, prompt_token_ids=[8, 9])
    assert eng.step() == [] and not eng.healthy and fails["n"] == 0  # second attempt failed
    outs = _run(eng)
    assert eng.healthy and eng.get_stats().num_cache_rebuilds == 1
    assert outs["b"].outputs[0].token_ids == ReferenceGenerator(config, params).generate([[8, 9]], 5)[0]
    assert eng.block_manager.get_num_free_gpu_blocks() == 32


def test_async_device_error_at_collection_fails_only_that_step(tiny, monkeypatch):
    """With async scheduling a device error surfaces when the host collects a step, after
    the next step was launched: the failed step's requests fail, the lost cache is rebuilt,
    the request that arrives next equals the reference, and the pool is whole."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_num_seqs=4, layer_loop="scan", async_scheduling=True)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", None, sp, prompt_token_ids=[5, 6, 7])
    eng.step()
    eng.step()  # "a" decodes on the device, its first token collected
    # The engine collects a step through the runner's `fetch` (device_get, or reading in
    # place on one CPU device): the failure is injected there, whichever the runner picked.
    real, calls = eng.runner.fetch, []

    def failing(x):
        calls.append(1)
        if len(calls) == 1:
            eng.runner.k_cache.delete()  # what a device failure after donation leaves behind
            raise RuntimeError("device fell over")
        return real(x)

    monkeypatch.setattr(eng.runner, "fetch", failing)
    outs = {o.request_id: o for o in eng.step()}
    monkeypatch.setattr(eng.runner, "fetch", real)
    assert calls, "the step was not collected through runner.fetch"
    assert "device fell over" in outs["a"].error and outs["a"].finished
    assert eng.get_stats().num_cache_rebuilds == 1 and not eng.runner.cache_lost()
    prompts = [[8, 9, 10, 11], [5, 6, 7]]
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == ReferenceGenerator(config, params).generate(prompts, 6)
    assert eng.block_manager.get_num_free_gpu_blocks() == 32
    assert not eng.has_unfinished_requests()
