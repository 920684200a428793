"""n>1 / best_of end to end: seed rule, shared prompt memory, best_of ranking, CoW isolation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from tests.sharing.helpers import assert_pool_whole, rand_prompt

BS = 16


@pytest.fixture(scope="module")
def llm(demo_model, demo_tokenizer):
    config, params = demo_model
    # Synchronous steps: these tests read block tables between steps, and with async
    # scheduling a step's fan-out and writes land one step() call later.
    return LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, block_size=BS,
                           max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=False)


def test_n_samples_equal_separate_requests_seeded_s_plus_j(demo_model, llm):
    config, _ = demo_model
    prompt = {"prompt_token_ids": rand_prompt(np.random.default_rng(0), 21, config.vocab_size)}
    # logprobs=0: cumulative logprobs are reported only where logprobs are asked (vLLM V1).
    kw = dict(temperature=0.9, top_k=40, max_tokens=8, ignore_eos=True, logprobs=0)
    grouped = llm.generate(prompt, SamplingParams(n=3, seed=11, **kw))[0]
    separate = llm.generate([prompt] * 3, [SamplingParams(seed=11 + j, **kw) for j in range(3)])
    assert [c.index for c in grouped.outputs] == [0, 1, 2]
    assert [c.token_ids for c in grouped.outputs] == [s.outputs[0].token_ids for s in separate]
    assert len({tuple(c.token_ids) for c in grouped.outputs}) == 3, "samples should differ"
    np.testing.assert_allclose([c.cumulative_logprob for c in grouped.outputs],
                               [s.outputs[0].cumulative_logprob for s in separate], atol=1e-4)
    assert_pool_whole(llm)


def test_best_of_returns_n_best_by_cumulative_logprob(demo_model, llm):
    config, _ = demo_model
    prompt = {"prompt_token_ids": rand_prompt(np.random.default_rng(1), 9, config.vocab_size)}
    kw = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    all5 = llm.generate(prompt, SamplingParams(n=5, **kw))[0].outputs
    best2 = llm.generate(prompt, SamplingParams(n=2, best_of=5, **kw))[0].outputs
    ranked = sorted(all5, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best2] == [c.token_ids for c in ranked]
    assert [c.index for c in best2] == [0, 1]
    assert best2[0].cumulative_logprob >= best2[1].cumulative_logprob
    assert_pool_whole(llm)


def test_group_memory_is_prompt_once_plus_per_sample_blocks(demo_model, llm):
    config, _ = demo_model
    eng, bm = llm.engine, llm.engine.block_manager
    n, p_len = 4, 2 * BS + 5  # two full prompt blocks + a partial one
    prompt = rand_prompt(np.random.default_rng(2), p_len, config.vocab_size)
    eng.add_request("g", None, SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=30,
                                              ignore_eos=True), prompt_token_ids=prompt)
    for _ in range(15):  # mid-generation step boundary: 15 tokens per sample, 52 slots, 4 blocks
        eng.step()
    seqs = eng._requests["g"].group.get_unfinished_seqs()
    assert len(seqs) == n
    tables = [bm.get_block_table(s) for s in seqs]
    shared = p_len // BS
    per_sample = [len(t) - shared for t in tables]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert bm.gpu.get_num_used() == shared + sum(per_sample)
    assert bm.gpu.get_num_used() == sum(len(t) for t in tables) - (n - 1) * shared  # vs no sharing
    last = [t[shared] for t in tables]  # the prompt's partial block: one private copy each
    assert len(set(last)) == n
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(llm)


def _kv_of(eng, table: list[int], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of a sequence's first ``num_tokens`` tokens, read through its block table."""
    k = np.asarray(jax.device_get(eng.runner.k_cache[:, :, np.array(table)]))
    v = np.asarray(jax.device_get(eng.runner.v_cache[:, :, np.array(table)]))
    s = k.shape
    k = k.reshape(s[0], s[1], s[2] * s[3], s[4])[:, :, :num_tokens]
    v = v.reshape(s[0], s[1], s[2] * s[3], s[4])[:, :, :num_tokens]
    return k, v


def test_copy_on_write_isolation_kv_equals_recompute(demo_model, llm):
    """After forking, each sample's KV (read through its own table) equals a from-scratch
    prefill of its own tokens, and the shared prompt blocks are never written again."""
    config, _ = demo_model
    eng, bm = llm.engine, llm.engine.block_manager
    p_len = BS + 7
    prompt = rand_prompt(np.random.default_rng(4), p_len, config.vocab_size)
    eng.add_request("c", None, SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20,
                                              ignore_eos=True), prompt_token_ids=prompt)
    eng.step()  # prompt + fan-out: samples share every block
    seqs = eng._requests["c"].group.get_unfinished_seqs()
    shared_block = bm.get_block_table(seqs[0])[0]
    assert all(bm.get_block_table(s)[:2] == bm.get_block_table(seqs[0])[:2] for s in seqs)
    before = _kv_of(eng, [shared_block], BS)
    for _ in range(6):  # writes into the shared partial block must copy it first
        eng.step()
    tables = [bm.get_block_table(s) for s in seqs]
    assert len({t[1] for t in tables}) == 3, "siblings' partial blocks must have diverged"
    snaps = [(s.get_token_ids()[: s.num_computed_tokens], _kv_of(eng, t, s.num_computed_tokens))
             for s, t in zip(seqs, tables)]
    for a, b in zip(before, _kv_of(eng, [shared_block], BS)):
        np.testing.assert_array_equal(a, b)
    assert len({tuple(ids) for ids, _ in snaps}) == 3
    while eng.has_unfinished_requests():
        eng.step()
    for i, (ids, (k, v)) in enumerate(snaps):  # recompute each sample alone, compare KV
        rid = f"re{i}"
        eng.add_request(rid, None, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        prompt_token_ids=ids)
        eng.step()
        seq = eng._requests[rid].group.seqs[0]
        k2, v2 = _kv_of(eng, bm.get_block_table(seq), len(ids))
        np.testing.assert_allclose(k, k2, atol=2e-4, rtol=1e-3)
        np.testing.assert_allclose(v, v2, atol=2e-4, rtol=1e-3)
        eng.abort_request(rid)
        eng.step()
    assert_pool_whole(llm)
