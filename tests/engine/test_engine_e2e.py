"""The paged engine end to end on the demo model, checked against the reference generator."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.outputs import RequestOutput
from pagedjax.reference import ReferenceGenerator, RefSampling
from pagedjax.serving.async_engine import merge_output


def assert_pool_whole(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(demo_model):
    config, params = demo_model
    return ReferenceGenerator(config, params)


def _workload(seed: int, n: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, vocab, rng.integers(3, 60))) for _ in range(n)]
    max_tokens = [int(m) for m in rng.integers(4, 24, n)]
    return [[int(t) for t in p] for p in prompts], max_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_reference_under_preemption(demo_model, demo_tokenizer, reference, mode):
    config, params = demo_model
    prompts, max_tokens = _workload(1, 40, config.vocab_size)
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=40, block_size=16,
                          max_num_seqs=16, max_num_batched_tokens=512, preemption_mode=mode)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    want = reference.generate(prompts, max_tokens, eos_token_ids=config.eos_token_ids)
    for out, w, p in zip(outs, want, prompts):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == w
    assert llm.engine.get_stats().num_preemptions_total > 0, "workload was meant to force preemption"
    assert_pool_whole(llm)


def test_seeded_sampling_independent_of_batch(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    prompt = {"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}
    alone = llm.generate(prompt, sp)[0].outputs[0].token_ids
    others, _ = _workload(5, 6, config.vocab_size)
    mixed = llm.generate([{"prompt_token_ids": o} for o in others[:3]] + [prompt]
                         + [{"prompt_token_ids": o} for o in others[3:]],
                         [SamplingParams(temperature=1.0, max_tokens=8)] * 3 + [sp]
                         + [SamplingParams(temperature=0.5, max_tokens=5)] * 3)
    assert mixed[3].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=12)
    assert llm.generate(prompt, unseeded)[0].outputs[0].token_ids != alone
    assert_pool_whole(llm)


def test_abort_mid_generation_frees_blocks(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8)
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        prompt_token_ids=list(range(10 + i, 40 + i)))
    for _ in range(4):
        eng.step()
    assert eng.block_manager.get_num_free_gpu_blocks() < eng.runner.num_gpu_blocks
    eng.abort_request("r1")
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["r1"].outputs[0].finish_reason == "abort"
    assert 0 < len(finals["r1"].outputs[0].token_ids) < 40
    assert finals["r0"].outputs[0].finish_reason == "length"
    assert len(finals["r2"].outputs[0].token_ids) == 40
    assert_pool_whole(llm)


def test_update_params_uses_new_weights_without_recompiling(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8,
                          enable_prefix_caching=True)
    prompts, _ = _workload(9, 4, config.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    new_params = jax.tree.unflatten(tree, [
        x + 0.02 * jax.numpy.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    jax.block_until_ready(new_params)
    llm.update_params(new_params)
    compiles = llm.engine.get_stats().num_compiles
    after = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert llm.engine.get_stats().num_compiles == compiles, "weight swap must not recompile"
    want = ReferenceGenerator(config, new_params).generate(prompts, 10)
    assert after == want
    assert after != before
    assert llm.engine.runner.num_gpu_blocks == 64
    assert_pool_whole(llm)


def test_bad_inputs_rejected_by_field(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=32, max_model_len=256)
    eng = llm.engine
    cases = [
        (dict(prompt=""), "prompt"),
        (dict(prompt=None, prompt_token_ids=[]), "prompt"),
        (dict(prompt=None, prompt_token_ids=list(range(300))), "max_model_len"),
        (dict(prompt=None, prompt_token_ids=[1, config.vocab_size]), "prompt_token_ids"),
        (dict(prompt=None, prompt_token_ids=[1, -3]), "prompt_token_ids"),
        (dict(prompt="hi", params={"temperature": -1.0}), "temperature"),
        (dict(prompt="hi", params={"top_p": 0.0}), "top_p"),
        (dict(prompt="hi", params={"top_k": -2}), "top_k"),
        (dict(prompt="hi", params={"max_tokens": 0}), "max_tokens"),
        (dict(prompt="hi", params={"bogus_field": 1}), "bogus_field"),
        (dict(prompt="a\ud800b"), "prompt: not valid Unicode"),  # lone surrogate
        (dict(prompt="x" * (64 * 256 + 1)), "prompt: 16385 characters"),  # before tokenizing
        (dict(prompt="hi", params={"temperature": float("inf")}), "temperature"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            eng.add_request("bad", kwargs.pop("prompt"), kwargs.pop("params", None), **kwargs)
    eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    for rid in ("forged\nINFO request done", "x" * 257):  # log-line forging, unbounded ids
        with pytest.raises(ValueError, match="request_id"):
            eng.add_request(rid, "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM.from_params(config, params, demo_tokenizer, preemption_mode="drop")
    while eng.has_unfinished_requests():
        eng.step()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_whole(llm)


def test_request_larger_than_cache_rejected(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV blocks|cache"):
        llm.generate({"prompt_token_ids": list(range(5, 100))}, SamplingParams(max_tokens=4))
    assert_pool_whole(llm)


def test_step_failure_isolated_and_blocks_freed(demo_model, demo_tokenizer, monkeypatch):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64)
    eng = llm.engine
    eng.add_request("a", "Hello there", SamplingParams(temperature=0, max_tokens=3))
    real = eng.runner.execute
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real(inputs)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    outs = eng.step()
    assert outs[0].request_id == "a" and outs[0].finished and "device fell over" in outs[0].error
    assert eng.block_manager.get_num_free_gpu_blocks() == eng.runner.num_gpu_blocks
    good = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(good.outputs[0].token_ids) == 3 and good.error is None
    assert_pool_whole(llm)


def test_stops_logprobs_and_streaming(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    base = llm.chat(chat, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in base.text and base.finish_reason == "stop"
    cut = llm.chat(chat, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    assert cut.text == base.text[: base.text.index("Paris")]
    first = base.token_ids[2]
    st = llm.chat(chat, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first]))[0].outputs[0]
    assert st.token_ids == base.token_ids[:3] and st.stop_reason == first
    mt = llm.chat(chat, SamplingParams(temperature=0, max_tokens=24, min_tokens=20,
                                       ignore_eos=False))[0].outputs[0]
    # The unconstrained answer ends with EOS well before 20 tokens; with min_tokens every EOS
    # id is banned until then (not sampled and skipped over), so the text runs on past it.
    eos = llm.engine.eos_token_ids
    assert len(base.token_ids) < 20 and base.token_ids[-1] in eos
    assert len(mt.token_ids) >= 20 and not set(mt.token_ids[:20]) & eos
    assert mt.token_ids[: len(base.token_ids) - 1] == base.token_ids[:-1]
    lp = llm.chat(chat, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 5
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert tok in entry and len(entry) == 3  # greedy token is the top-1
        assert max(entry.values()) == entry[tok] <= 0.0
    # Streaming: cumulative text grows monotonically and ends at the full text.
    prompt = demo_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    stream = llm.generate_stream(prompt, SamplingParams(temperature=0, max_tokens=24))
    texts = [o.outputs[0].text for o in stream]
    assert len(texts) > 3 and texts[-1] == base.text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert_pool_whole(llm)


def test_seeded_reference_sampling_agrees_on_greedy(reference, demo_model):
    """Sanity of the oracle itself: temperature 0 in RefSampling is argmax."""
    out = reference.generate([[1, 2, 3]], 3, RefSampling(temperature=0.0))
    logits = reference.prompt_logits([1, 2, 3])
    assert out[0][0] == int(np.argmax(logits[-1]))


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_reference(demo_model, demo_tokenizer, reference, chunked):
    config, params = demo_model
    kwargs = dict(enable_chunked_prefill=True, max_num_batched_tokens=16) if chunked else {}
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, **kwargs)
    prompts, _ = _workload(21, 3, config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    for out, p in zip(outs, prompts):
        logits = reference.prompt_logits(p).astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for pos in range(len(p) - 1):
            entry = out.prompt_logprobs[pos + 1]
            assert entry[p[pos + 1]] == pytest.approx(logp[pos, p[pos + 1]], abs=1e-3)
            top = np.argsort(-logp[pos])[:2]
            assert set(top.tolist()) <= set(entry)
    assert_pool_whole(llm)


def test_prompt_logprobs_with_prefix_caching_compute_the_whole_prompt(demo_model,
                                                                     demo_tokenizer):
    """As vLLM V1: a request asking for prompt logprobs takes no prefix-cache hits (every
    position is computed and scored) though its prompt is cached, and its blocks are published
    for the requests after it. Its logprobs equal those of an engine without prefix caching."""
    config, params = demo_model
    prompts, _ = _workload(22, 3, config.vocab_size)
    prompts = [p * (1 + 40 // len(p)) for p in prompts]  # over 40 tokens: 2 full blocks
    plain = SamplingParams(temperature=0, max_tokens=2)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64).generate(
        [{"prompt_token_ids": p} for p in prompts], scored)
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64,
                          enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], plain)[0]
    assert first.num_cached_tokens == 0
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], scored)
    for w, g, p in zip(want, got, prompts):
        assert g.num_cached_tokens == 0  # prompts[0] was cached: not read
        assert len(g.prompt_logprobs) == len(p) and g.prompt_logprobs[0] is None
        for pos in range(1, len(p)):
            assert set(g.prompt_logprobs[pos]) == set(w.prompt_logprobs[pos])
            for tok, lp in w.prompt_logprobs[pos].items():
                assert g.prompt_logprobs[pos][tok] == pytest.approx(lp, abs=1e-4)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], plain)
    assert all(o.num_cached_tokens >= 32 for o in again)  # published by the scored requests
    assert_pool_whole(llm)


def test_bad_tensor_parallel_config_fails_before_loading(demo_gguf, monkeypatch):
    import models.loader

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the configuration was checked")

    monkeypatch.setattr(models.loader, "load_model", must_not_load)
    from pagedjax.parallel import TensorParallelError

    with pytest.raises(TensorParallelError, match="tensor_parallel_size"):
        LLM(str(demo_gguf), tensor_parallel_size=2)


def test_warmup_compiles_buckets_so_serving_does_not(demo_model, demo_tokenizer):
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=256, warmup=True)
    shapes = set(llm.engine.runner.compiled_shapes)
    plan = llm.engine.runner.shape_plan
    assert shapes == set(plan.step_shapes())
    # Decode from one sequence up; prefill steps' sequence and row counts follow the tokens.
    # The native CPU kernel's cost follows real lengths: one table width (16 blocks).
    assert plan.widths == [16]
    assert {(1, 1, 16, 1, True), (8, 8, 16, 8, True), (64, 8, 16, 8, False),
            (64, 8, 16, 72, False)} <= shapes
    compiles = llm.engine.get_stats().num_compiles
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 20, 33)],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert llm.engine.runner.compiled_shapes == shapes  # every step hit a warmed bucket
    assert llm.engine.get_stats().num_compiles == compiles
    assert_pool_whole(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["contiguous-oracle", "contiguous-pow2", "contiguous-max", "static"])
def test_contiguous_baselines_give_same_outputs(demo_model, demo_tokenizer, reference, policy,
                                                async_scheduling):
    """The paper's baselines change memory management only: outputs equal the reference, with
    steps synchronous or asynchronous (a contiguous table one block short of a pending token
    that starts a block gave wrong tokens from the second one on)."""
    config, params = demo_model
    prompts, max_tokens = _workload(31, 6, config.vocab_size)
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, block_size=16,
                          max_model_len=256, max_num_seqs=8, kv_policy=policy,
                          async_scheduling=async_scheduling)
    assert llm.engine.runner.feed_tokens is async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    want = reference.generate(prompts, max_tokens, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.get_num_free_gpu_blocks() == 64
    with pytest.raises(ValueError, match="kv_policy"):
        LLM.from_params(config, params, demo_tokenizer, kv_policy="segmented")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_update_params_mid_flight_recomputes_in_flight_requests(demo_model, demo_tokenizer,
                                                                async_scheduling):
    """Tokens after a weight swap come from the new weights over the whole context: each
    continuation equals the new model's greedy continuation of prompt + tokens so far (no
    request mixes KV computed with the old weights into the new ones). With async scheduling
    the step in flight at the swap completes with the old weights: "so far" is what the
    engine holds once the swap returns, delivered or not."""
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8,
                          async_scheduling=async_scheduling)
    eng = llm.engine
    prompts, _ = _workload(5, 3, config.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, sp, prompt_token_ids=p)
    so_far: dict[str, list[int]] = {}
    while not so_far or min(len(t) for t in so_far.values()) < 4:
        for out in eng.step():
            so_far[out.request_id] = list(out.outputs[0].token_ids)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    new_params = jax.tree.unflatten(tree, [
        x + 0.1 * jax.numpy.std(x) * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys)])
    llm.update_params(new_params)
    for rid, req in eng._requests.items():  # the drained step's tokens count as so far
        so_far[rid] = list(req.group.seqs[0].output_token_ids)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    ref = ReferenceGenerator(config, new_params)
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        k = len(so_far[rid])
        assert final[rid][:k] == so_far[rid]
        assert final[rid][k:] == ref.generate([p + so_far[rid]], 10 - k)[0], rid
    assert_pool_whole(llm)


def test_final_only_requests_emit_one_output(demo_model, demo_tokenizer):
    """output_kind="final_only" (what LLM.generate uses) returns nothing until the request
    finishes, then the same result a cumulative request gets; a bad kind names the field."""
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=4)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("final", None, sp, prompt_token_ids=[5, 6, 7], output_kind="final_only")
    eng.add_request("cumul", None, sp, prompt_token_ids=[5, 6, 7])
    seen: dict[str, list] = {"final": [], "cumul": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["cumul"]) == 5
    assert seen["final"][0].outputs[0].token_ids == seen["cumul"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        eng.add_request("x", None, sp, prompt_token_ids=[5], output_kind="partial")
    assert_pool_whole(llm)


def test_delta_outputs_add_up_to_the_cumulative_ones(demo_model, demo_tokenizer):
    """output_kind="delta": each output holds only what the step added (its tokens, their
    logprobs, the text released), and they add up to what a cumulative request of the same
    params ends with: n = 2 samples, logprobs, a stop string that cuts the text (held back
    until it can no longer be cut), a length stop. Per-step work does not grow with the
    output: no delta carries more tokens than the step computed."""
    config, params = demo_model
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=128, max_num_seqs=8)
    eng = llm.engine
    prompt = demo_tokenizer("The capital of France is").input_ids
    cases = {
        "plain": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        "n2": SamplingParams(temperature=0.9, top_p=0.95, seed=3, n=2, max_tokens=10,
                             ignore_eos=True),
        "stop": None,  # filled below with a stop string from the greedy continuation
    }
    ref = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    stop = ref[6:9]  # three characters inside the continuation: it cuts the text there
    assert len(stop) == 3 and stop.strip()
    cases["stop"] = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    for kind in ("cumulative", "delta"):
        for name, sp in cases.items():
            eng.add_request(f"{kind}-{name}", None, sp, prompt_token_ids=prompt,
                            output_kind=kind)
    final: dict[str, RequestOutput] = {}
    acc: dict[str, dict[int, list]] = {}
    merged: dict[str, RequestOutput] = {}  # the servers' accumulation (`merge_output`)
    prefixes = []  # the text sent so far, after every delta
    while eng.has_unfinished_requests():
        for out in eng.step():
            kind, name = out.request_id.split("-", 1)
            if kind == "cumulative":
                final[name] = out
                continue
            merged[name] = (copy.deepcopy(out) if name not in merged
                            else merge_output(merged[name], out))
            for c in out.outputs:
                a = acc.setdefault(name, {}).setdefault(c.index, ["", [], [], None, 0])
                assert len(c.token_ids) <= 1  # one token per step per sequence here
                assert a[3] is None, "output after the finish"
                a[0] += c.text
                prefixes.append((name, c.index, a[0]))
                a[1] += c.token_ids
                a[2] += c.logprobs or []
                a[3] = c.finish_reason
                a[4] += 1
    for name, out in final.items():
        assert out.finished
        for c in out.outputs:
            text, toks, lps, reason, n = acc[name][c.index]
            assert (text, toks, reason) == (c.text, c.token_ids, c.finish_reason)
            assert lps == (c.logprobs or [])
            assert n >= len(toks)  # an output every step, not one at the end
        m = merged[name]
        assert m.finished and [c.index for c in m.outputs] == [c.index for c in out.outputs]
        for c, d in zip(out.outputs, m.outputs):
            assert (d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason) == (
                c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            assert d.cumulative_logprob == pytest.approx(c.cumulative_logprob)
    for name, index, sent in prefixes:  # text once sent is never cut (the stop string's)
        assert final[name].outputs[index].text.startswith(sent)
    assert final["stop"].outputs[0].finish_reason == "stop"
    assert final["stop"].outputs[0].text == ref[: ref.index(stop)]
    assert_pool_whole(llm)


def test_final_only_text_is_decoded_at_the_end_and_equals_the_streamed_text(
        demo_model, demo_tokenizer, monkeypatch):
    """A final-only request without stop strings is detokenized once, when it finishes (or
    its output is made: an abort), not a token at a time: no per-step detokenization runs,
    and its text is what streaming gives, the whole output decoded. Random tokens at
    temperature 1 split UTF-8 characters across tokens and draw special tokens. (Per-step
    detokenization: the detokenizer's calls, or a token's text from the token-text tables
    released into its state, as `listed_rows` and `stream_rows` do.)"""
    from pagedjax.detokenizer import DetokState

    release = DetokState.release
    config, params = demo_model
    prompts, max_tokens = _workload(9, 6, config.vocab_size)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=m + 8, ignore_eos=True)
           for i, m in enumerate(max_tokens)]
    finals = {}
    for kind in ("cumulative", "final_only"):
        llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, max_num_seqs=8)
        eng = llm.engine
        det = eng.outputs.detokenizer
        calls = []
        for name in ("append_token", "step"):
            real = getattr(det, name)
            setattr(det, name, lambda *a, _real=real, _n=name, _calls=calls, **k: (
                _calls.append(_n), _real(*a, **k))[1])
        monkeypatch.setattr(DetokState, "release", lambda *a, _calls=calls: (
            _calls.append("release"), release(*a))[1])
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            eng.add_request(f"r{i}", None, sp, output_kind=kind, prompt_token_ids=p)
        got, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o
            steps += 1
            if steps == 4:
                eng.abort_request("r0")
        finals[kind] = got
        assert (not calls) if kind == "final_only" else len(calls) > steps, (kind, calls[:5], steps)
        assert_pool_whole(llm)
    for rid, out in finals["final_only"].items():
        c = out.outputs[0]
        assert c.text == demo_tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if rid == "r0":
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < sps[0].max_tokens
        else:
            assert c.token_ids == finals["cumulative"][rid].outputs[0].token_ids
            assert c.text == finals["cumulative"][rid].outputs[0].text
