"""`LLMEngine.pipe_rows`: the engine process's child takes running text-free deltas as pipe
rows made straight from request state (`OutputProcessor.delta_row`), and a steady step's
running rows as a `pipe_block` of columns (`OutputProcessor.stream_rows`, `listed_rows`);
the front end decodes from the pipe exactly the `RequestOutput`s the engine would have made
(`encode_outputs`, `decode_outputs`), step by step. (Within a step the outputs' order is the
engine's: each is one request's, so steps are compared sorted.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.serving.engine_process import decode_outputs, encode_outputs
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=9).get)


def _params(i: int, rng: np.random.Generator) -> SamplingParams:
    m = int(rng.integers(1, 20))
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    if kind == 1:  # logprobs travel in the row
        return SamplingParams(temperature=0.9, seed=i, max_tokens=m, logprobs=2)
    if kind == 2:  # stop ids: a finish reason and a stop reason
        return SamplingParams(temperature=0, max_tokens=m,
                              stop_token_ids=[int(t) for t in rng.integers(3, 90, 8)])
    if kind == 3:  # two samples: made as RequestOutputs
        return SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=m)
    return SamplingParams(temperature=0, max_tokens=m, prompt_logprobs=1)  # ditto


def _steady_params(i: int, rng: np.random.Generator, logprobs: bool = False
                   ) -> tuple[SamplingParams, str]:
    """Mostly rows `stream_rows` makes (greedy or sampled, stop ids, min_tokens), among
    quiet final-only rows; one in six it does not (logprobs: `listed_rows`). With
    ``logprobs``, every stream has them: steps of listed rows and quiet ones only."""
    m = int(rng.integers(4, 40))
    kind = i % 6
    if logprobs and kind:
        kind = 3
    if kind == 0:
        return SamplingParams(temperature=0.9, seed=i, max_tokens=m), "final_only"
    if kind == 1:
        return SamplingParams(temperature=0, max_tokens=m,
                              stop_token_ids=[int(t) for t in rng.integers(3, 90, 6)]), "delta_ids"
    if kind == 2:
        return SamplingParams(temperature=0.8, seed=i, top_p=0.9, max_tokens=m,
                              min_tokens=3), "delta_ids"
    if kind == 3:  # 1, 2 or 3 logprobs: a step's top-k columns as wide as the widest
        return SamplingParams(temperature=0, max_tokens=m, logprobs=1 + i // 6 % 3), "delta_ids"
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), "delta_ids"


def _pipe(tiny, rows: bool, *, steady: bool = False, async_scheduling: bool = True,
          blocks: int = 64, logprobs: bool = False) -> tuple[list[list[tuple]], int, int, int]:
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=blocks, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    engine.pipe_rows = rows
    rng = np.random.default_rng(1)
    pending = []
    for i in range(24 if steady else 20):
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(2, 30)))]
        sp, kind = _steady_params(i, rng, logprobs) if steady else (_params(i, rng),
                                                                     "delta_ids")
        pending.append((f"r{i}", prompt, sp, kind))
    steps, sent, made, prompts, logprob_blocks = [], set(), 0, {}, 0
    streamed = [0]
    real = engine.outputs.stream_rows

    def counted(*args):
        got = real(*args)
        streamed[0] += _rows(got[0])
        return got

    engine.outputs.stream_rows = counted
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                rid, prompt, sp, kind = pending.pop(0)
                engine.add_request(rid, None, sp, prompt_token_ids=prompt, output_kind=kind)
        if len(steps) == 6:
            engine.abort_request("r7")  # an abort's output after rows
        outs = engine.step()
        made += _rows(outs)
        logprob_blocks += sum(type(o) is tuple and o[0] is None and o[3] is not None
                              for o in outs)
        steps.append(sorted(map(_fields, decode_outputs(encode_outputs(outs, sent), prompts)),
                            key=lambda r: r[0]))
    assert not sent and not prompts  # every finished request's prompt forgotten, both ends
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return steps, made, streamed[0], logprob_blocks


def _rows(outs: list) -> int:
    """Outputs made as pipe rows: `delta_row`s and the rows of `pipe_block`s."""
    return sum(len(o[1]) if o[0] is None else 1 for o in outs if type(o) is tuple)


def _fields(o) -> tuple:
    """A decoded output's fields; of the first scheduled time (the clock's), whether it is
    set."""
    return (o.request_id, o.prompt, o.prompt_token_ids,
            [dataclasses.astuple(c) for c in o.outputs], o.finished, o.prompt_logprobs,
            o.num_cached_tokens, o.error, o.first_scheduled_time is not None)


def test_pipe_rows_carry_what_the_outputs_would(tiny):
    objects, none, _, _ = _pipe(tiny, False)
    rows, made, _, _ = _pipe(tiny, True)
    assert none == 0 and made > 40
    assert rows == objects


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("blocks", [200, 14])
def test_steady_pipe_rows_carry_what_the_outputs_would(tiny, async_scheduling, blocks,
                                                       monkeypatch):
    """Steady steps of pipe rows (`stream_rows` with ``pipe``), with async scheduling on and
    off; 14 blocks of 8 tokens hold a few of the 8 sequences, so preemption cuts cohorts. The
    logprob rows among them are listed beside the others (`LLMEngine._steady_classes`); with
    none listed (the general path for those steps) the outputs are the same."""
    from pagedjax.core import Scheduler
    from pagedjax.engine import LLMEngine

    listed = [0]
    real = Scheduler.update_steady

    def steady(self, run, token_ids, pending, rows=None, logprobs=None):
        listed[0] += bool(rows)
        return real(self, run, token_ids, pending, rows, logprobs)

    kw = dict(steady=True, async_scheduling=async_scheduling, blocks=blocks)
    objects, none, _, _ = _pipe(tiny, False, **kw)
    monkeypatch.setattr(Scheduler, "update_steady", steady)
    rows, made, streamed, logprob_blocks = _pipe(tiny, True, **kw)
    assert none == 0
    assert streamed > 30  # the steady steps did make their rows from the columns
    assert listed[0] > 5  # ... with the logprob rows listed beside them
    assert logprob_blocks > 5  # ... and sent as blocks of logprob columns
    assert rows == objects
    with monkeypatch.context() as m:
        m.setattr(LLMEngine, "LISTED_MAX_SHARE", 0.0)
        general, _, _, _ = _pipe(tiny, False, **kw)
    assert general == objects
    # The deltas add up to each stream's whole output: max_tokens where nothing stops it.
    ids: dict[str, list[int]] = {}
    for step in rows:
        for r in step:
            ids.setdefault(r[0], []).extend(r[3][0][2])
    rng = np.random.default_rng(1)
    checked = 0
    for i in range(24):
        rng.integers(3, tiny[0].vocab_size, int(rng.integers(2, 30)))  # the prompt's draws
        sp, kind = _steady_params(i, rng)
        if kind == "delta_ids" and sp.ignore_eos and f"r{i}" != "r7":
            assert len(ids[f"r{i}"]) == sp.max_tokens, i
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_steps_of_logprob_streams_go_as_blocks(tiny, async_scheduling, monkeypatch):
    """Every stream with logprobs, beside quiet final-only rows: the whole step is listed
    (no row for `stream_rows`), and its running rows still cross as `pipe_block`s
    (`LLMEngine._steady_classes`: a listed stream makes the step not quiet)."""
    from pagedjax.engine import LLMEngine

    kw = dict(steady=True, async_scheduling=async_scheduling, blocks=200, logprobs=True)
    objects, _, _, _ = _pipe(tiny, False, **kw)
    rows, made, _, logprob_blocks = _pipe(tiny, True, **kw)
    assert rows == objects
    assert logprob_blocks > 10 and made > 60
    with monkeypatch.context() as m:
        m.setattr(LLMEngine, "LISTED_MAX_SHARE", 0.0)
        general, _, _, _ = _pipe(tiny, False, **kw)
    assert general == objects


def test_pipe_rows_switch_drops_the_cached_cohort_answer(tiny):
    """Turning `pipe_rows` on after steps were classified without it (as the host-overhead
    bench does) takes the column path from the next steady step."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True),
                           prompt_token_ids=[5 + i, 9, 11], output_kind="delta_ids")
    for _ in range(6):
        outs = engine.step()
    assert not any(type(o) is tuple for o in outs)
    engine.pipe_rows = True
    for _ in range(3):
        outs = engine.step()
    assert len(outs) == 1 and outs[0][0] is None and len(outs[0][1]) == 4  # one block
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
