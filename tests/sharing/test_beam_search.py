"""Beam search in the engine equals a naive beam search that shares nothing and recomputes all."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import init_contiguous_cache
from pagedjax import LLM, SamplingParams
from pagedjax.baselines.buddy_allocator import next_pow2
from pagedjax.reference import ReferenceGenerator
from tests.sharing.helpers import assert_pool_whole

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "import numpy as np\nimport"]
# (prompt, width, n, max_tokens, length_penalty, early_stopping, extra EOS id or None)
CASES = [
    (0, 2, 1, 8, 1.0, False, None),
    (1, 3, 2, 7, 1.0, False, 198),  # "\n" ends hypotheses: exercises the finished path
    (2, 4, 2, 6, 0.5, False, None),
    (3, 5, 3, 6, 1.0, True, 198),
    (0, 6, 2, 6, 2.0, False, 13),
]


def _last_logprobs(ref: ReferenceGenerator, beams: list[list[int]]) -> np.ndarray:
    """log_softmax of each beam's next-token logits, recomputed from scratch over the whole sequence.

    All beams have the same length; padded to 8 rows and a power-of-two length so the contiguous
    reference compiles once per length bucket.
    """
    n = len(beams[0])
    s = max(16, 1 << (n - 1).bit_length())
    arr = np.zeros((8, s), np.int32)
    arr[: len(beams), :n] = beams
    pos = np.where(np.arange(s) < n, np.arange(s), -1)[None].repeat(8, 0).astype(np.int32)
    cache = init_contiguous_cache(ref.config, 8, s, ref.dtype)
    logits, _ = ref._forward(ref.params, cache, arr, pos, jnp.arange(8, dtype=jnp.int32) * s + n - 1)
    x = np.asarray(logits, np.float64)[: len(beams)]
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def naive_beam_search(ref, prompt, width, n, max_tokens, eos, length_penalty, early_stopping):
    """Textbook beam search: every beam keeps its own token list, nothing is shared or cached."""
    p_len = len(prompt)
    live = [(list(prompt), 0.0)]
    finished: list[tuple[float, list[int], float]] = []
    for step in range(max_tokens):
        cands = []
        all_lp = _last_logprobs(ref, [ids for ids, _ in live])
        for b, ((_ids, cum), lp) in enumerate(zip(live, all_lp)):
            for t in np.argsort(-lp, kind="stable")[: 2 * width]:
                cands.append((cum + lp[t], b, int(t)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        new_live = []
        for rank, (s, b, t) in enumerate(cands[: 2 * width]):
            ids = live[b][0]
            if t in eos:
                if rank < width:
                    finished.append((s / len(ids) ** length_penalty, ids[p_len:] + [t], s))
            elif len(new_live) < width:
                new_live.append((ids + [t], s))
            if len(new_live) == width:
                break
        live = new_live
        if step == max_tokens - 1:
            finished += [(s / len(ids) ** length_penalty, ids[p_len:], s) for ids, s in live]
            break
        if len(finished) >= width:
            if early_stopping is True:
                break
            worst = min(sorted((f[0] for f in finished), reverse=True)[:width])
            ids, s = live[0]
            if worst >= s / len(ids) ** length_penalty:
                break
    return sorted(finished, key=lambda f: -f[0])[:n]


@pytest.fixture(scope="module")
def llm(demo_model, demo_tokenizer):
    config, params = demo_model
    return LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=96, block_size=8,
                           max_num_seqs=32, max_num_batched_tokens=256)


def test_beam_search_equals_naive_beam_search(demo_model, demo_tokenizer, llm):
    config, params = demo_model
    ref = ReferenceGenerator(config, params)
    prompts = [demo_tokenizer(PROMPTS[c[0]]).input_ids for c in CASES]
    sps = [SamplingParams(use_beam_search=True, best_of=w, n=n, temperature=0, max_tokens=m,
                          length_penalty=lp, early_stopping=es, stop_token_ids=[e] if e else None)
           for _, w, n, m, lp, es, e in CASES]
    copies = []
    orig_copy = llm.engine.runner.copy_blocks
    llm.engine.runner.copy_blocks = lambda pairs: (copies.extend(pairs), orig_copy(pairs))[1]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)  # all groups batched
    finally:
        llm.engine.runner.copy_blocks = orig_copy
    any_stopped = False
    for out, prompt, (_, w, n, m, lp, es, e) in zip(outs, prompts, CASES):
        eos = set(config.eos_token_ids) | ({e} if e else set())
        want = naive_beam_search(ref, prompt, w, n, m, eos, lp, es)
        got = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
        assert [g[0] for g in got] == [w_[1] for w_ in want], (w, n)
        np.testing.assert_allclose([g[1] for g in got], [w_[2] for w_ in want], rtol=1e-4, atol=1e-3)
        assert [c.index for c in out.outputs] == list(range(n))
        any_stopped |= any(c.finish_reason == "stop" for c in out.outputs)
    assert any_stopped, "some case was meant to finish hypotheses by EOS"
    assert copies, "forked beams writing a shared partial block must copy it"
    assert_pool_whole(llm)


def test_beam_children_share_blocks_and_copy_only_partial_last_block(demo_tokenizer, llm):
    eng = llm.engine
    bs = eng.engine_config.block_size
    prompt = demo_tokenizer(PROMPTS[2]).input_ids
    eng.add_request("b", None, SamplingParams(use_beam_search=True, best_of=4, temperature=0,
                                              max_tokens=12, ignore_eos=True), prompt_token_ids=prompt)
    copies: list[tuple[int, int]] = []
    orig_copy = eng.runner.copy_blocks
    eng.runner.copy_blocks = lambda pairs: (copies.extend(pairs), orig_copy(pairs))[1]
    try:
        for _ in range(4):
            eng.step()
        req = eng._requests["b"]
        seqs = req.group.get_unfinished_seqs()
        tables = [eng.block_manager.get_block_table(s) for s in seqs]
        full = len(prompt) // bs
        assert len(seqs) == 4
        # Full prompt blocks are physically shared by every beam; memory < no sharing.
        assert all(t[:full] == tables[0][:full] for t in tables)
        used = eng.block_manager.gpu.get_num_used()
        assert used == len({b for t in tables for b in t}) < sum(len(t) for t in tables)
        # Every copy's source was a partially filled block at the time (never a full one):
        # a full block is shared read-only, only the block being written is copied.
        full_blocks = set(tables[0][:full])
        assert not any(src in full_blocks for src, _ in copies)
    finally:
        eng.runner.copy_blocks = orig_copy
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(llm)


def test_beam_group_split_by_token_budget_gives_same_beams(demo_model, demo_tokenizer, llm):
    """A budget smaller than the beam count computes a group's beams over several steps; their
    logits rows wait on device until every live beam has one, so results do not change."""
    config, params = demo_model
    tight = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, block_size=8,
                            max_num_seqs=8, max_num_batched_tokens=3, enable_chunked_prefill=True)
    prompt = {"prompt_token_ids": demo_tokenizer(PROMPTS[1]).input_ids}
    sp = SamplingParams(use_beam_search=True, best_of=4, n=4, temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate(prompt, sp)[0].outputs
    got = tight.generate(prompt, sp)[0].outputs
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    np.testing.assert_allclose([c.cumulative_logprob for c in got],
                               [c.cumulative_logprob for c in want], atol=1e-4)
    assert_pool_whole(tight)
    assert_pool_whole(llm)


@pytest.mark.parametrize("policy", ["contiguous-oracle", "contiguous-max"])
def test_beam_search_on_contiguous_kv_with_no_spare_region(demo_model, demo_tokenizer, llm, policy):
    """Contiguous baselines give every beam its own region. The pool holds exactly the groups'
    reservations, so a beam forked after the first step can only reuse the region of a beam
    dropped in the same step: the engine must free dropped beams before forking survivors."""
    config, params = demo_model
    bs, max_len, width, n, m = 8, 32, 4, 2, 8
    prompts = [demo_tokenizer(PROMPTS[i]).input_ids for i in (0, 1, 2)]
    region = {  # blocks per beam, a power of two (the buddy allocator rounds up)
        "contiguous-oracle": [next_pow2(-(-(len(p) + m) // bs)) for p in prompts],
        "contiguous-max": [next_pow2(max_len // bs)] * len(prompts),
    }[policy]
    assert len(set(region)) == 1, "equal regions: the pool tiles with no fragmentation"
    num_blocks = width * sum(region)
    tight = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=num_blocks, block_size=bs,
                            max_model_len=max_len, max_num_seqs=32, max_num_batched_tokens=256,
                            kv_policy=policy)
    sp = SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0, max_tokens=m,
                        stop_token_ids=[198])
    reqs = [{"prompt_token_ids": p} for p in prompts]
    forks = []  # (free blocks, whether a spare reserved at admission took the child) per fork
    bm = tight.engine.block_manager
    orig_fork = bm.fork

    def fork(parent, child):
        forks.append((bm.get_num_free_gpu_blocks(), bool(bm._spares.get(parent.seq_id))))
        orig_fork(parent, child)
        bm.check_invariants()

    bm.fork = fork
    try:
        got = tight.generate(reqs, sp)  # all groups admitted together: the pool is then full
    finally:
        bm.fork = orig_fork
    want = llm.generate(reqs, sp)
    assert forks[0] == (0, True), "every group admitted at once: the pool is full"
    assert any(not spare for _, spare in forks), "some fork had to allocate a region"
    for g, w in zip(got, want):
        assert len(g.outputs) == n
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        np.testing.assert_allclose([c.cumulative_logprob for c in g.outputs],
                                   [c.cumulative_logprob for c in w.outputs], atol=1e-4)
    assert_pool_whole(tight)
    assert_pool_whole(llm)
