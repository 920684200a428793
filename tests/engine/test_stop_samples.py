"""`LLMEngine.stop_samples`: single samples of n > 1 requests ended from outside the engine
(the engine process's front end finds their stop strings). A stopped sample's tokens are a
prefix of what it would have generated, its siblings generate exactly what they would have,
the engine stops computing it, and the block pool is whole afterwards: with async
scheduling on and off, and under preemption by swap and recompute."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

N_REQ = 10


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def _requests(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(3)
    return [(f"r{i}", [int(t) for t in rng.integers(3, vocab, int(rng.integers(4, 40)))],
             SamplingParams(n=3, temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True,
                            logprobs=1 if i % 2 else None))
            for i in range(N_REQ)]


def _run(tiny, async_scheduling: bool, mode: str, plan: dict | None):
    """Every request's tokens per sample, finish and stop reasons, and the tokens the engine
    generated. ``plan``: (request, sample) -> after how many of its tokens it is stopped."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                          max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, swap_space_gb=0.01,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    for rid, prompt, sp in _requests(config.vocab_size):
        engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind="delta_ids")
    tokens: dict[tuple[str, int], list[int]] = {}
    ends: dict[tuple[str, int], tuple] = {}
    asked: set[tuple[str, int]] = set()
    finished = set()
    while engine.has_unfinished_requests():
        stops = []
        for out in engine.step():
            assert out.request_id not in finished
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key in ends:  # ended: the engine's later deltas say nothing new
                    assert not c.token_ids and (c.finish_reason, c.stop_reason) == ends[key]
                    continue
                tokens.setdefault(key, []).extend(c.token_ids)
                if c.finish_reason is not None:
                    ends[key] = (c.finish_reason, c.stop_reason)
                elif plan and key not in asked and len(tokens[key]) >= plan.get(key, 1 << 30):
                    asked.add(key)
                    stops.append((*key, f"stop{c.index}"))
            if out.finished:
                finished.add(out.request_id)
        engine.stop_samples(stops)
    assert len(finished) == N_REQ
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return tokens, ends, engine.generation_tokens_total, engine.get_stats()


@pytest.mark.parametrize("async_scheduling,mode", [(False, "recompute"), (True, "swap"),
                                                   (True, "recompute")])
def test_stopped_samples_end_and_their_siblings_run_on(tiny, async_scheduling, mode):
    rng = np.random.default_rng(7)
    # Samples stopped part way; requests 0 and 1 lose every sample, the last one ending them.
    plan = {(f"r{i}", j): int(rng.integers(1, 20)) for i in range(N_REQ) for j in range(3)
            if i < 2 or rng.random() < 0.4}
    full, full_ends, full_total, _ = _run(tiny, async_scheduling, mode, None)
    got, ends, total, stats = _run(tiny, async_scheduling, mode, plan)
    assert stats.num_preemptions_total > 0  # the pool is small enough to preempt
    assert set(got) == set(full)
    for key, want in full.items():
        if key in plan:
            # Stopped after its step that reached the planned length, or ended earlier by
            # itself: its tokens are a prefix of the unstopped run's.
            assert ends[key] in (("stop", f"stop{key[1]}"), full_ends[key]), key
            assert got[key] == want[:len(got[key])], key
            if ends[key][0] == "stop":
                assert plan[key] <= len(got[key]) < len(want), key
        else:
            assert got[key] == want and ends[key] == full_ends[key], key
    # The engine stopped computing them: what it generated shrank by what the plan cut.
    cut = sum(len(full[k]) - len(got[k]) for k in plan)
    assert cut > 50 and total <= full_total - cut + 3 * len(plan)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_stops_aborts_and_reused_ids_under_preemption_leave_nothing_behind(tiny, mode):
    """A front end's worst case: samples stopped while their request is preempted, the
    request aborted and its id reused at once, all between two steps. Every incarnation of
    every id ends exactly once, without an error, none stalls, and the pool is whole."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=20, block_size=8,
                          max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, swap_space_gb=0.01, async_scheduling=True)
    engine = llm.engine
    rng = np.random.default_rng(11 if mode == "swap" else 12)
    ids = [f"a{i}" for i in range(6)]
    live: dict[str, int] = {}  # id -> incarnations still to end (an abort's end comes later)
    made = ended = steps = 0

    def add(rid: str) -> None:
        nonlocal made
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(4, 40)))]
        sp = SamplingParams(n=int(rng.integers(1, 4)), temperature=1.0,
                            seed=int(rng.integers(1 << 20)), max_tokens=int(rng.integers(4, 40)),
                            ignore_eos=True)
        engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind="delta_ids")
        live[rid] = live.get(rid, 0) + 1
        made += 1

    while made < 120 or engine.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "a request stalled"
        # Half the time aim at a preempted request whose samples have forked.
        preempted = [g.request_id for g in [*engine.scheduler.swapped, *engine.scheduler.waiting]
                     if len(g.seqs) > 1]
        # Once every request is in, the rest must end by themselves: none may stall.
        for _ in range(int(rng.integers(0, 4)) if made < 120 else 0):
            op = rng.random()
            rid = ids[int(rng.integers(len(ids)))]
            if preempted and rng.random() < 0.5:
                rid = preempted[int(rng.integers(len(preempted)))]
            if rid not in live:
                add(rid)
            elif op < 0.5:
                engine.stop_samples([(rid, int(rng.integers(3)), "x")])
                if rid in preempted and rng.random() < 0.5:
                    engine.abort_request(rid)  # its group has a sample finished elsewhere
                    add(rid)
            elif op < 0.7:
                engine.abort_request(rid)
                add(rid)  # the id reused before the next step
        for out in engine.step():
            assert out.error is None, out.error  # a lost scheduler entry fails its request
            if out.finished:
                live[out.request_id] -= 1
                if not live[out.request_id]:
                    del live[out.request_id]
                ended += 1
    assert ended == made and not live
    assert engine.get_stats().num_preemptions_total > 0
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
