"""`LLMEngine.pipe_rows`: the engine process's child takes running text-free deltas as pipe
rows made straight from request state (`OutputProcessor.delta_row`); the pipe carries exactly
what the `RequestOutput`s would have become (`encode_outputs`), step by step."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.serving.engine_process import encode_outputs
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


def _pipe(tiny, rows: bool) -> tuple[list[list[tuple]], int]:
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          async_scheduling=True)
    engine = llm.engine
    engine.pipe_rows = rows
    rng = np.random.default_rng(1)
    pending = [(f"r{i}", [int(t) for t in rng.integers(3, config.vocab_size,
                                                       int(rng.integers(2, 30)))],
                _params(i, rng)) for i in range(20)]
    steps, sent, made = [], set(), 0
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, None, sp, prompt_token_ids=prompt,
                                   output_kind="delta_ids")
        if len(steps) == 6:
            engine.abort_request("r7")  # an abort's output after rows
        outs = engine.step()
        made += sum(type(o) is tuple for o in outs)
        # The first scheduled time is the clock's: only whether it is set is compared.
        steps.append([(*r[:7], r[7] is not None) for r in encode_outputs(outs, sent)])
    assert not sent  # every finished request's prompt forgotten
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return steps, made


def test_pipe_rows_carry_what_the_outputs_would(tiny):
    objects, none = _pipe(tiny, False)
    rows, made = _pipe(tiny, True)
    assert none == 0 and made > 40
    assert rows == objects
