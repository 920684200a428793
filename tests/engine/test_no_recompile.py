"""After warm-up, serving never compiles (issue 15): a long randomized workload mixing every
feature that picks shapes runs with zero new XLA compilations, counted from JAX's own
compile events (`pagedjax.worker.compile_stats`), and greedy requests still match the
reference generator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from pagedjax.worker.compile_stats import num_backend_compiles
from pallas_kernels import cpu_native
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=7).get)


def _random_params(rng: np.random.Generator, beams: bool = True) -> SamplingParams:
    kind = rng.integers(0, 7)
    if kind == 3 and not beams:  # speculation refuses beam search
        kind = 0
    max_tokens = int(rng.integers(1, 24))
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.9, top_p=0.8, top_k=int(rng.integers(1, 40)),
                              seed=int(rng.integers(0, 1000)), n=int(rng.integers(1, 4)),
                              max_tokens=max_tokens, logprobs=int(rng.integers(0, 21)))
    if kind == 2:
        return SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                              repetition_penalty=1.2, min_tokens=min(3, max_tokens),
                              max_tokens=max_tokens, min_p=0.05)
    if kind == 3:
        return SamplingParams(use_beam_search=True, best_of=int(rng.integers(2, 5)),
                              n=1, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 4:
        return SamplingParams(temperature=1.0, n=2, best_of=int(rng.integers(2, 4)),
                              max_tokens=max_tokens, stop=["1 2", "5"],
                              stop_token_ids=[int(rng.integers(3, 90))])
    if kind == 5:  # with prefix caching too: such a request takes no prefix hits
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              prompt_logprobs=int(rng.integers(0, 6)), logprobs=2)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          min_tokens=min(2, max_tokens))


# Speculative decoding (n-gram): steps of 1 + k tokens per drafted sequence and up to one
# sampled row per token.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


# "unrolled": the CPU serving default, whose runner applies the LM head itself where plain
# greedy rows take the screened head (`sample_greedy_hidden`; by default only where the native
# library has a vector path for it, so both ways are forced here); the suite's default is the
# scan (tests/conftest.py).
@pytest.mark.parametrize("mode,prefix_caching,async_scheduling,spec,layer_loop,screen",
                         [("swap", True, False, None, None, "1"),
                          ("recompute", False, False, None, None, "1"),
                          ("recompute", True, True, None, None, "1"),
                          ("swap", False, False, SPEC, None, "1"),
                          ("recompute", True, True, SPEC, None, "1"),
                          ("recompute", True, True, None, "unrolled", "1"),
                          ("recompute", True, True, None, "unrolled", "0")])
def test_zero_compiles_after_warmup(tiny, mode, prefix_caching, async_scheduling, spec,
                                    layer_loop, screen, monkeypatch):
    config, params = tiny
    monkeypatch.setenv("PAGEDJAX_SCREENED_HEAD", screen)
    # 24 blocks of 8 slots for up to 8 sequences of up to 128 tokens: preemption is frequent.
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=24, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, enable_prefix_caching=prefix_caching,
                          enable_chunked_prefill=True, swap_space_gb=0.01,
                          async_scheduling=async_scheduling, speculative_config=spec,
                          warmup=True, layer_loop=layer_loop)
    engine = llm.engine
    if layer_loop == "unrolled" and cpu_native.available():
        assert (engine.runner.head_screen is not None) is (screen == "1")
    compiles = num_backend_compiles()
    shapes = set(engine.runner.compiled_shapes)
    rng = np.random.default_rng((3 if prefix_caching else 4) + 2 * async_scheduling)
    shared = [int(t) for t in rng.integers(3, config.vocab_size, 24)]  # prefix-cache hits
    requests = []
    for i in range(60):
        n = int(rng.integers(1, 70))
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, n)]
        if i % 3 == 0:
            prompt = shared + prompt[:40]
        requests.append((f"r{i}", prompt, _random_params(rng, spec is None)))
    outputs, pending = {}, list(requests)
    aborted = set()
    while pending or engine.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 4))):  # arrivals between steps
            if pending:
                rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, None, sp, prompt_token_ids=prompt)
        if rng.random() < 0.03 and engine._requests:  # aborts mid-flight
            rid = sorted(engine._requests)[0]
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    # A steady tail of sampled rows: their metadata is kept across steps and cut down as
    # they end (`worker.cohort_metadata`), with arguments of the kinds built metadata has.
    hits = engine.cohort_meta.num_hits, engine.cohort_meta.num_cuts
    for i, m in enumerate(rng.permutation(np.arange(12, 32, 5))):
        sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=int(m), ignore_eos=True,
                            logprobs=1 if i % 2 else None)
        engine.add_request(f"tail{i}", None, sp,
                           prompt_token_ids=[int(t) for t in rng.integers(3, 60, 8)])
    while engine.has_unfinished_requests():
        engine.step()
    if spec is None:
        assert engine.cohort_meta.num_hits > hits[0] + 10 and engine.cohort_meta.num_cuts > hits[1]
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert spec is None or stats.spec_num_accepted_tokens > 0
    assert num_backend_compiles() == compiles, "serving compiled after warm-up"
    assert engine.runner.compiled_shapes == shapes
    assert len(outputs) == len(requests)
    assert all(o.error is None for o in outputs.values())
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    # Greedy single-sample requests equal the reference (beams/penalties/seeds aside).
    greedy = [(rid, p, sp) for rid, p, sp in requests
              if rid not in aborted and sp.temperature == 0 and not sp.use_beam_search
              and sp.min_tokens == 0 and sp.ignore_eos]
    assert len(greedy) >= 5
    ref = ReferenceGenerator(config, params).generate(
        [p for _, p, _ in greedy], [sp.max_tokens for _, _, sp in greedy])
    assert [outputs[rid].outputs[0].token_ids for rid, _, _ in greedy] == ref


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 300), st.data())
def test_warm_up_covers_every_beam_selection_shape(max_num_seqs, data):
    """Any step's beam groups, as the scheduler admits them (each reserves its beam width of
    max_num_seqs), give a selection shape warm-up compiled: live beams 1..width per group
    (fewer after EOS endings), in any sampler batch holding their rows."""
    from pagedjax.beam_steps import selection_shape, warm_selection_shapes
    from pagedjax.engine import MAX_WARM_BEAM_WIDTH
    from pagedjax.worker.shapes import seq_bucket_list

    buckets = seq_bucket_list(max_num_seqs)
    warm = set(warm_selection_shapes(buckets, MAX_WARM_BEAM_WIDTH, max_num_seqs))
    groups, left = [], max_num_seqs
    while left >= 2 and (not groups or data.draw(st.booleans())):
        width = data.draw(st.integers(2, min(MAX_WARM_BEAM_WIDTH, left)))
        groups.append((data.draw(st.integers(1, width)), width))
        left -= width
    rows = sum(live for live, _ in groups)
    b = data.draw(st.sampled_from([b for b in buckets if b >= rows]))
    assert (b, *selection_shape(groups)) in warm


def test_the_beam_shapes_warm_up_used_to_miss():
    """Found in review: 16 width-8 one-token prefills in a 16-row step (groups x width = 8 x
    batch), and one width-4 group down to one live beam alone in a decode step (batch 1)."""
    from pagedjax.beam_steps import selection_shape, warm_selection_shapes
    from pagedjax.worker.shapes import seq_bucket_list

    warm = set(warm_selection_shapes(seq_bucket_list(256), 8, 256))
    assert (16, *selection_shape([(1, 8)] * 16)) == (16, 16, 8) and (16, 16, 8) in warm
    assert (1, *selection_shape([(1, 4)])) == (1, 1, 4) and (1, 1, 4) in warm
    # Never more groups than rows or than max_num_seqs // 2: no shape serving cannot reach.
    assert all(g < 2 * min(b, 128) for b, g, _w in warm)
