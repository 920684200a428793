"""Plain greedy rows that want no logprob take their tokens from the hidden states through the
screened LM head (`ModelRunner.head_outside`, `sample_greedy_hidden`), and the engine's
outputs are exactly those of the float32 head's logits (``PAGEDJAX_SCREENED_HEAD=0``): tokens,
stops, finish reasons, under preemption, with async scheduling on and off, after a weight
swap; rows that want logprobs take the logits; cumulative logprobs are reported only where
logprobs are asked (vLLM V1)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pallas_kernels import cpu_native
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="the screened head is a native CPU kernel")


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=11).get)


def _requests(vocab: int, logprobs=None) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(6)
    prompt = lambda: [int(t) for t in rng.integers(3, vocab, int(rng.integers(10, 40)))]  # noqa: E731
    reqs = [(prompt(), SamplingParams(temperature=0, max_tokens=int(rng.integers(10, 20)),
                                      ignore_eos=True, logprobs=logprobs)) for _ in range(7)]
    reqs.append((prompt(), SamplingParams(temperature=0, max_tokens=12, logprobs=logprobs,
                                          stop_token_ids=[5, 9, 40, 77])))
    return reqs


def _generate(config, params, reqs, monkeypatch, screened: bool, async_scheduling=True,
              swap=None, kind=None):
    """Outputs, `sample_greedy_hidden` calls, preemptions; ``swap``: params to swap in after
    a first generate (the outputs are then those of the second); ``kind``: the screen's
    (`lm_head_screen_kind`, via PAGEDJAX_LM_HEAD_INT8; None: the host's default)."""
    calls = []
    real = engine_mod.sample_greedy_hidden

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(engine_mod, "sample_greedy_hidden", counting)
    monkeypatch.setenv("PAGEDJAX_SCREENED_HEAD", "1" if screened else "0")
    if kind is not None:
        monkeypatch.setenv("PAGEDJAX_LM_HEAD_INT8", "1" if kind == "int8" else "0")
    # 10 blocks of 8 for 8 sequences of 20 to 59 tokens: preemption is certain. The head is
    # left to the runner with unrolled layers (the suite's default is the scan).
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=10, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          async_scheduling=async_scheduling, layer_loop="unrolled")
    assert llm.engine.runner.head_outside is screened
    if screened:
        assert (kind or cpu_native.lm_head_screen_kind()) in llm.engine.runner.head_screen
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params_list = [sp for _, sp in reqs]
    outs = llm.generate(prompts, params_list)
    if swap is not None:
        llm.engine.update_params(swap)
        calls.clear()
        outs = llm.generate(prompts, params_list)
    engine = llm.engine
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    monkeypatch.undo()
    return outs, len(calls), engine.get_stats().num_preemptions_total


def _tokens(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _has_int8() -> bool:
    """The engine screens in 8 bits here (AVX512-VNNI; AMX hosts keep bfloat16 tiles)."""
    return (cpu_native.available() and "avx512vnni" in cpu_native.compiled_isa()
            and not cpu_native.lm_head_amx())


@pytest.mark.parametrize("kind", ["bf16", pytest.param("int8", marks=pytest.mark.skipif(
    not _has_int8(), reason="the engine screens in 8 bits on AVX512-VNNI hosts without AMX"))])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_screened_tokens_equal_the_float32_heads(tiny, monkeypatch, async_scheduling, kind):
    config, params = tiny
    reqs = _requests(config.vocab_size)
    fast, n_fast, pre = _generate(config, params, reqs, monkeypatch, True, async_scheduling,
                                  kind=kind)
    full, n_full, _ = _generate(config, params, reqs, monkeypatch, False, async_scheduling)
    assert n_fast > 0 and n_full == 0 and pre > 0  # the screen ran, under preemption
    assert _tokens(fast) == _tokens(full)
    for o in fast + full:
        assert all(c.cumulative_logprob is None and c.logprobs is None for c in o.outputs)


def test_rows_that_want_logprobs_take_the_logits(tiny, monkeypatch):
    config, params = tiny
    reqs = _requests(config.vocab_size, logprobs=0)
    outs, n, _ = _generate(config, params, reqs, monkeypatch, True)
    full, _, _ = _generate(config, params, reqs, monkeypatch, False)
    assert n == 0
    assert _tokens(outs) == _tokens(full)
    for o, f in zip(outs, full, strict=True):
        for c, d in zip(o.outputs, f.outputs, strict=True):
            assert c.cumulative_logprob is not None and c.cumulative_logprob < 0
            np.testing.assert_allclose(c.cumulative_logprob, d.cumulative_logprob, rtol=1e-6)
            assert len(c.logprobs) == len(c.token_ids)


def test_a_weight_swap_rebuilds_the_screen(tiny, monkeypatch):
    """After `update_params` the screen is the new head's: the same tokens as the float32
    head with the new weights, which differ from the old weights' tokens."""
    config, params = tiny
    other = assemble_params(config, random_hf_tensors(config, seed=12).get)
    reqs = _requests(config.vocab_size)[:4]
    fast, n, _ = _generate(config, params, reqs, monkeypatch, True, swap=other)
    full, _, _ = _generate(config, params, reqs, monkeypatch, False, swap=other)
    old, _, _ = _generate(config, params, reqs, monkeypatch, False)
    assert n > 0
    assert _tokens(fast) == _tokens(full) != _tokens(old)
