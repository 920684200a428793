"""Plain decode rows (`LLMEngine._rows_for` / `_apply_plain`, `Scheduler.update_from_rows`):
steps whose every row is a one-sample request's lone sequence take their rows from a cache
kept by sequence id and apply their tokens without a `SampledToken` per row. The outputs
equal those of the general path (every step forced through `_rows_for_general` and
`update_from_output`): greedy, seeded sampling, logprobs, penalties, stop ids, lengths, a
fan-out request mixed in, requests aborted and their ids reused, with async scheduling on and
off and preemption by swap and recompute, and steps whose rows are all quiet (their tokens
need no output processing until they finish); the cache forgets every sequence that ends,
and the block pool is whole afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.core import Scheduler
from tests.engine.helpers import finished_key
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def _requests(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(11)
    kinds = [dict(temperature=0, ignore_eos=True),
             dict(temperature=0.9, seed=7, top_p=0.9),
             dict(temperature=0, logprobs=2),
             dict(temperature=0.7, seed=3, presence_penalty=0.5, repetition_penalty=1.2),
             dict(temperature=0, stop_token_ids=[int(t) for t in rng.integers(3, vocab, 12)]),
             dict(temperature=0.8, seed=5, n=2)]  # a fan-out: its steps take the general path
    out = []
    for i in range(14):
        prompt = [int(t) for t in rng.integers(3, vocab, int(rng.integers(3, 30)))]
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(3, 26)),
                                                    **kinds[i % len(kinds)])))
    return out


def _run(tiny, async_scheduling: bool, mode: str, plain: bool, monkeypatch):
    config, params = tiny
    calls = []
    real_plain = engine_mod.LLMEngine._apply_plain

    def counted(self, fl, out):
        calls.append(len(fl.row_info))
        return real_plain(self, fl, out)

    monkeypatch.setattr(engine_mod.LLMEngine, "_apply_plain", counted)
    real_rows = Scheduler.update_from_rows
    quiet_steps = []

    def rows_counted(self, rows, *a, **k):
        quiet_steps.append(k.get("ended_only", False))
        return real_rows(self, rows, *a, **k)

    monkeypatch.setattr(Scheduler, "update_from_rows", rows_counted)
    if not plain:  # every step through the general rows and `update_from_output`
        monkeypatch.setattr(engine_mod.LLMEngine, "_rows_for", lambda self, sched: (
            *self._rows_for_general(sched), False))
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128,
                          preemption_mode=mode, swap_space_gb=0.01,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    reqs = _requests(config.vocab_size)
    pending = list(reqs)
    results: dict[str, tuple] = {}
    step = 0
    aborted_seqs: set[int] = set()
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # arrivals spread over the run
            rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind="final_only")
        if step == 9:  # abort one in flight and reuse its id at once
            req = engine._requests.get("r1")
            if req is not None:
                aborted_seqs |= {s.seq_id for s in req.group.seqs}
                engine.abort_request("r1")
            engine.add_request("r1", None, reqs[1][2], prompt_token_ids=reqs[1][1] + [5],
                               output_kind="final_only")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = finished_key(out)
        step += 1
        assert step < 2000
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    # Every sequence that ended was forgotten; only the aborted one may linger.
    assert set(engine._plain_rows) <= aborted_seqs
    assert engine.scheduler.num_preemptions_total > 0  # the pool is small enough to preempt
    return results, (calls, quiet_steps)


@pytest.mark.parametrize("async_scheduling,mode", [(False, "recompute"), (True, "swap"),
                                                   (True, "recompute")])
def test_plain_rows_give_the_general_paths_outputs(tiny, async_scheduling, mode, monkeypatch):
    with monkeypatch.context() as m:
        general, none = _run(tiny, async_scheduling, mode, False, m)
    with monkeypatch.context() as m:
        plain, (calls, quiet) = _run(tiny, async_scheduling, mode, True, m)
    assert not none[0]
    assert len(calls) > 10 and max(calls) > 1  # the plain path took many multi-row steps
    # Steps whose rows were all quiet (only ended sequences listed) and steps with a row
    # that wanted logprobs, or its first token.
    assert True in quiet and False in quiet
    assert set(general) == {f"r{i}" for i in range(14)}
    assert plain == general
