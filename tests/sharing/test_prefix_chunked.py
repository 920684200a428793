"""Prefix caching (automatic and pinned) and chunked prefill end to end, against the reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.sharing.helpers import assert_pool_whole, rand_prompt

BS = 16
MAX_TOKENS = 6
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(demo_model):
    config, params = demo_model
    return ReferenceGenerator(config, params)


def _shared_prefix_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves; wave 2 shares with wave 1 prefixes of length ≡ 0, 1 and bs-1 (mod bs)."""
    rng = np.random.default_rng(7)
    wave1, wave2 = [], []
    for plen in (2 * BS, 2 * BS + 1, 3 * BS - 1):
        prefix = rand_prompt(rng, plen, vocab)
        wave1.append(prefix + rand_prompt(rng, 5, vocab))
        wave2.append(prefix + rand_prompt(rng, 20, vocab))
        wave2.append(prefix[: plen - 1] + rand_prompt(rng, 3, vocab))  # diverges one token early
    wave2.append(wave1[0][: 2 * BS])  # a prompt that is entirely cached full blocks
    return wave1, wave2


CONFIGS = [
    dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    dict(enable_prefix_caching=True, enable_chunked_prefill=False),
    dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=32),
    dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=64),
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(),  # the defaults: both on, as in vLLM V1
]


@pytest.fixture(scope="module")
def expected(demo_model, reference):
    config, _ = demo_model
    wave1, wave2 = _shared_prefix_prompts(config.vocab_size)
    want = reference.generate(wave1 + wave2, MAX_TOKENS, ignore_eos=True)
    return wave1, wave2, want


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "base")
def test_greedy_identical_across_caching_and_chunking(demo_model, demo_tokenizer, expected, cfg):
    config, params = demo_model
    wave1, wave2, want = expected
    kw = dict(num_gpu_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=256)
    kw.update(cfg)
    llm = LLM.from_params(config, params, demo_tokenizer, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in wave1], SP)
    outs += llm.generate([{"prompt_token_ids": p} for p in wave2], SP)
    assert [o.outputs[0].token_ids for o in outs] == want
    cached = [o.num_cached_tokens for o in outs[len(wave1):]]
    assert llm.engine.engine_config.enable_prefix_caching is cfg.get("enable_prefix_caching", True)
    if cfg.get("enable_prefix_caching", True):
        # Hits are the full blocks of the shared prefix; a prompt made only of cached blocks
        # still computes its last token (for logits).
        assert cached == [2 * BS, BS, 2 * BS, 2 * BS, 2 * BS, 2 * BS, 2 * BS - 1]
    else:
        assert cached == [0] * len(cached)
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def small_llm(demo_model, demo_tokenizer):
    """10 blocks of 16 tokens: a few prompts are enough to force LRU eviction."""
    config, params = demo_model
    return LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=10, block_size=BS,
                           max_num_seqs=4, max_num_batched_tokens=128, enable_prefix_caching=True)


def _pressure(llm: LLM, vocab: int, seed: int) -> None:
    """Distinct prompts whose blocks together exceed the pool, evicting every unpinned entry."""
    rng = np.random.default_rng(seed)
    llm.generate([{"prompt_token_ids": rand_prompt(rng, 58, vocab)} for _ in range(4)], SP)


def test_eviction_under_pressure_then_reuse_recomputes_correctly(demo_model, reference, small_llm):
    config, _ = demo_model
    prompt = rand_prompt(np.random.default_rng(21), 40, config.vocab_size)
    want = reference.generate([prompt], MAX_TOKENS, ignore_eos=True)[0]
    first = small_llm.generate({"prompt_token_ids": prompt}, SP)[0]
    assert small_llm.generate({"prompt_token_ids": prompt}, SP)[0].num_cached_tokens == 32
    _pressure(small_llm, config.vocab_size, 22)
    again = small_llm.generate({"prompt_token_ids": prompt}, SP)[0]
    assert again.num_cached_tokens == 0, "pressure was meant to evict the prompt's blocks"
    third = small_llm.generate({"prompt_token_ids": prompt}, SP)[0]
    assert third.num_cached_tokens == 32  # recomputed blocks were published again
    for out in (first, again, third):
        assert out.outputs[0].token_ids == want
    assert_pool_whole(small_llm)


def test_pinned_prefix_survives_pressure_and_is_hit(demo_model, demo_tokenizer, reference, small_llm):
    config, _ = demo_model
    rng = np.random.default_rng(31)
    prefix = rand_prompt(rng, 2 * BS + 3, config.vocab_size)
    handle = small_llm.register_prefix(prefix)
    assert handle.complete and len(handle.blocks) == 2
    _pressure(small_llm, config.vocab_size, 32)
    prompt = prefix + rand_prompt(rng, 9, config.vocab_size)
    out = small_llm.generate({"prompt_token_ids": prompt}, SP)[0]
    assert out.num_cached_tokens == 2 * BS
    assert out.outputs[0].token_ids == reference.generate([prompt], MAX_TOKENS, ignore_eos=True)[0]
    bm = small_llm.engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks - 2  # only the pins remain
    small_llm.unpin_prefix(handle)
    assert_pool_whole(small_llm)
    text_handle = small_llm.register_prefix("You are a helpful assistant. Answer briefly and " * 3)
    assert text_handle.complete and text_handle.blocks
    small_llm.unpin_prefix(text_handle)
    assert_pool_whole(small_llm)


def test_forced_hash_collisions_never_read_another_prompts_kv(demo_model, demo_tokenizer, reference,
                                                            monkeypatch):
    import pagedjax.core.block_pool as block_pool
    from tests.conftest import CollidingKey

    monkeypatch.setattr(block_pool, "block_key", CollidingKey)
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=32, block_size=BS,
                          max_num_seqs=4, max_num_batched_tokens=128, enable_prefix_caching=True)
    rng = np.random.default_rng(41)
    x, y = rand_prompt(rng, 2 * BS, config.vocab_size), rand_prompt(rng, 2 * BS, config.vocab_size)
    prompts = [x + [5, 6, 7], y + [8, 9], x + [10, 11, 12, 13], y[:BS] + x[BS:] + [14],
               rand_prompt(rng, 2 * BS + 2, config.vocab_size)]
    want = reference.generate(prompts, MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SP)
    for p in prompts[2:]:
        outs += llm.generate({"prompt_token_ids": p}, SP)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Every key hashes alike, yet only true token-prefix matches hit.
    assert [o.num_cached_tokens for o in outs[2:]] == [2 * BS, BS, 0]
    assert_pool_whole(llm)


def test_update_params_invalidates_cached_and_pinned_prefixes(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=32, block_size=BS,
                          max_num_seqs=4, max_num_batched_tokens=128, enable_prefix_caching=True)
    rng = np.random.default_rng(51)
    prefix = rand_prompt(rng, 2 * BS, config.vocab_size)
    prompts = [prefix + rand_prompt(rng, 4, config.vocab_size) for _ in range(2)]
    handle = llm.register_prefix(prefix)
    assert [o.num_cached_tokens for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP)] \
        == [2 * BS, 2 * BS]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    new_params = jax.tree.unflatten(tree, [
        x + 0.02 * jax.numpy.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    llm.update_params(new_params)
    assert not handle.valid
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP)
    assert outs[0].num_cached_tokens == 0
    want = ReferenceGenerator(config, new_params).generate(prompts, MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.unpin_prefix(handle)  # already released by the swap: a no-op
    assert_pool_whole(llm)
