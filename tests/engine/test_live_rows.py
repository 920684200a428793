"""Steps padded to their token bucket multiply only their real tokens (`DecoderLM` passes
``cu_q_lens[num_seqs]`` to the native panel matmul as ``live_rows``): the engine's outputs are
exactly those of multiplying every padded row, logprobs and prompt logprobs included, in
prefill-only, mixed and decode steps, under preemption; and the live count reaches every
layer matmul of the unrolled CPU model."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pallas_kernels import cpu_native
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="the panel matmul is a native CPU kernel")


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=21).get)


def _run(config, params, monkeypatch, live: bool):
    """Outputs, and the live_rows each traced matmul call got (None: every row)."""
    seen = []
    real = cpu_native.dense_matmul_cpu

    def recording(x, panels, n, live_rows=None, silu_mul=False):
        seen.append(live_rows)
        return real(x, panels, n, live_rows, silu_mul)

    monkeypatch.setattr(cpu_native, "dense_matmul_cpu", recording)
    # The switch, not the kernel's `takes_live_rows`: that also decides the rotary tables'
    # barrier, whose graph XLA may round differently at full optimization.
    monkeypatch.setenv("PAGEDJAX_LIVE_ROWS", "1" if live else "0")
    rng = np.random.default_rng(3)
    # Prompt lengths that fill no token bucket (13 + 21 + ... tokens), logprobs and prompt
    # logprobs (whose logits rows are the prompt tokens), 10 blocks of 8 for 6 sequences of
    # up to 55 tokens: preemption, and chunked prefill beside decodes (64-token budget).
    lens = (13, 21, 7, 30, 18, 11)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, config.vocab_size, n)]}
               for n in lens]
    params_list = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=1 if i == 1 else None)
                   for i in range(len(lens))]
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=10, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          layer_loop="unrolled")
    outs = llm.generate(prompts, params_list)
    engine = llm.engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    assert engine.get_stats().num_preemptions_total > 0
    monkeypatch.undo()
    return outs, seen


def test_padding_rows_skipped_and_outputs_unchanged(tiny, monkeypatch):
    config, params = tiny
    fast, seen_fast = _run(config, params, monkeypatch, live=True)
    full, seen_full = _run(config, params, monkeypatch, live=False)
    # Every layer matmul got the step's live count (the LM head, outside the layers, none).
    layer_calls = [x for x in seen_fast if x is not None]
    assert layer_calls and len(layer_calls) % config.num_layers == 0
    assert all(x is None for x in seen_full)
    for a, b in zip(fast, full, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        for c, d in zip(a.outputs, b.outputs, strict=True):
            assert c.token_ids == d.token_ids and len(c.token_ids) == 25
            assert c.logprobs == d.logprobs  # the same bits
            assert c.cumulative_logprob == d.cumulative_logprob
    assert fast[1].prompt_logprobs is not None and len(fast[1].prompt_logprobs) == 21
