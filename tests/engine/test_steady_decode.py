"""Steady decode steps (`core.steady_decode`, `Scheduler._steady_step`,
`step_inputs.steady_decode_inputs`): a step that is the last step's lone decoding sequences
again is scheduled in one pass and built from columns. The outputs equal those with steady
steps turned off (greedy, seeded sampling, logprobs, penalties, stop ids, min_tokens, a
fan-out, lengths, an abort with its id reused) with async scheduling on and off and under
preemption by swap and recompute; cohorts are cut down as their sequences end, or (async)
wait for a last token still on the device; each steady step's arrays and pending-token rows
equal those the general path builds from the same step's entries, which then find every
persistent table row up to date; and the block pool is whole afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.core import Scheduler
from pagedjax.core.scheduler import PENDING_TOKEN
from pagedjax.core.sequence import SequenceStatus
from pagedjax.worker.step_inputs import build_step_inputs
from tests.engine.helpers import finished_key
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 256})
    return config, assemble_params(config, random_hf_tensors(config, seed=9).get)


def _requests(vocab: int, count: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(21)
    kinds = [dict(temperature=0, ignore_eos=True),
             dict(temperature=0, ignore_eos=True),
             dict(temperature=0.9, seed=7, top_p=0.9),
             dict(temperature=0, logprobs=2),
             dict(temperature=0.7, seed=3, presence_penalty=0.5, repetition_penalty=1.2),
             dict(temperature=0, stop_token_ids=[int(t) for t in rng.integers(3, vocab, 12)]),
             dict(temperature=0, min_tokens=6, ignore_eos=True),
             dict(temperature=0.8, seed=5, n=2)]
    out = []
    for i in range(count):
        prompt = [int(t) for t in rng.integers(3, vocab, int(rng.integers(3, 40)))]
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(8, 60)),
                                                    **kinds[i % len(kinds)])))
    return out


def _checked_inputs(checks: list):
    """`steady_decode_inputs` that also builds the general path's arrays from the step's
    entries and compares them: the same arrays, and no table row left to update."""
    real = engine_mod.steady_decode_inputs

    def both(sched, block_size, plan, batch):
        got = real(sched, block_size, plan, batch)
        rewrites, queued = batch.num_rewrites, len(batch._deltas)
        n = len(sched.steady.starts)
        want = build_step_inputs(sched.scheduled, block_size, batch.max_blocks_per_seq,
                                 [1] * n, [], plan=plan, batch=batch,
                                 num_tokens=sched.num_batched_tokens)
        assert (batch.num_rewrites, len(batch._deltas)) == (rewrites, queued)
        for name in ("input_ids", "positions", "logits_indices", "table_rows"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
        for name in ("slot_mapping", "kv_lens", "cu_q_lens", "num_seqs"):
            np.testing.assert_array_equal(getattr(got.meta, name), getattr(want.meta, name),
                                          name)
        assert got.shape_key == want.shape_key and got.sample_seq_pos == want.sample_seq_pos
        checks.append(n)
        return got

    return both


def _checked_feed(feeds: list):
    """`LLMEngine._steady_feed` that also finds each pending token's row as the general pass
    does, from the step's entries and the step before's rows, and compares."""
    real = engine_mod.LLMEngine._steady_feed

    def both(sched, inputs, prev):
        got = real(sched, inputs, prev)
        if got is not None:
            want = np.full(inputs.input_ids.shape, -1, np.int32)
            cu = inputs.meta.cu_q_lens
            for i, s in enumerate(sched.scheduled):
                if s.token_ids[-1] == PENDING_TOKEN:
                    want[cu[i + 1] - 1] = prev.pending_rows[s.seq_id]
            np.testing.assert_array_equal(got, want)
            feeds.append(sched.steady.cohort.parent is not None)
        return got

    return staticmethod(both)


def _run(tiny, async_scheduling: bool, mode: str, steady: bool, monkeypatch, blocks: int):
    config, params = tiny
    checks: list[int] = []
    feeds: list[bool] = []
    if steady:
        monkeypatch.setattr(engine_mod, "steady_decode_inputs", _checked_inputs(checks))
        monkeypatch.setattr(engine_mod.LLMEngine, "_steady_feed", _checked_feed(feeds))
    else:
        monkeypatch.setattr(Scheduler, "_steady_step", lambda self, st: False)
    # Sequences that ended by length, at their end: (tokens computed, tokens). The last
    # token is certainly the last (max_tokens or the model's length), so async scheduling
    # never schedules a step that computes it (`LLMEngine._pending_caps`).
    ends: list[tuple[int, int]] = []
    real_free = Scheduler.free_finished_seq_groups

    def free(self):
        ends.extend((s.num_computed_tokens, s.num_total_tokens) for g in self.running
                    for s in g.seqs if s.status is SequenceStatus.FINISHED_LENGTH)
        return real_free(self)

    monkeypatch.setattr(Scheduler, "free_finished_seq_groups", free)
    # max_model_len 72: some sequences end at the model's length, not their max_tokens.
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=blocks, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=72,
                          preemption_mode=mode, swap_space_gb=0.01,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    reqs = _requests(config.vocab_size, 12)
    pending = list(reqs)
    results: dict[str, tuple] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 5 == 0:  # arrivals spread over the run
            rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind="final_only")
        if step == 30:  # abort one in flight and reuse its id at once
            engine.abort_request("r1")
            engine.add_request("r1", None, reqs[1][2], prompt_token_ids=reqs[1][1] + [5],
                               output_kind="final_only")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = finished_key(out)
        step += 1
        assert step < 3000
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    assert len(ends) > 3 and all(c == t - 1 for c, t in ends), ends
    return results, engine.scheduler, (checks, feeds)


@pytest.mark.parametrize("async_scheduling,mode,blocks", [
    (False, "recompute", 120), (True, "recompute", 120), (True, "swap", 22),
    (False, "recompute", 22)])
def test_steady_steps_give_the_same_outputs(tiny, async_scheduling, mode, blocks, monkeypatch):
    with monkeypatch.context() as m:
        general, sched, _ = _run(tiny, async_scheduling, mode, False, m, blocks)
    assert sched.num_steady_steps == 0
    with monkeypatch.context() as m:
        steady, sched, (checks, feeds) = _run(tiny, async_scheduling, mode, True, m, blocks)
    assert set(general) == {f"r{i}" for i in range(12)}
    assert steady == general
    # Many steps were steady, and built from columns: the plain greedy tail of the run.
    assert sched.num_steady_steps > 10 and len(checks) > 5, (sched.num_steady_steps, checks)
    assert sched.num_steady_cuts > 0  # cohorts cut down as their sequences ended
    if async_scheduling:  # pending rows found from the cohort, cut down or not
        assert True in feeds and False in feeds, feeds
        # Sequences whose last token was on the device were left out of a steady step.
        assert sched.num_steady_idle_cuts > 0
    if blocks == 22:
        assert sched.num_preemptions_total > 0  # the small pool preempted
