"""Speculative decoding (n-gram proposer) through the engine.

Lossless: greedy outputs equal the engine's without speculation (and the reference
generator's) under recompute and swap preemption, prefix caching and chunked prefill, with
parallel samples, on a Llama and a hybrid Gemma 3 config; seeded sampling is token-for-token
identical (each draft row samples with the key and history of the unspeculated position);
unseeded sampling has the target's distribution (a two-sample chi-square test on a random
model whose drafts are mostly rejected). Rejected drafts' slots are rolled back: the pool is
whole after every run, including aborts mid-speculation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.loader import load_model
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.engine.test_hybrid_kv import _poison
from tests.model.test_families import write_family
from tests.parallel.tp_script import NoTokenizer, tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated spans (what n-gram lookup continues) and a shared head."""
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(3, vocab, 12)]
    out = []
    for _ in range(n):
        span = [int(t) for t in rng.integers(3, vocab, int(rng.integers(3, 7)))]
        out.append(head + span * int(rng.integers(2, 4)) + span[: int(rng.integers(1, 3))])
    return out


def _generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[o.token_ids for o in r.outputs] for r in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_plain_decoding(tiny, mode):
    config, params = tiny
    prompts = _prompts(config.vocab_size, 8)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = ReferenceGenerator(config, params).generate(prompts, [40] * len(prompts),
                                                       eos_token_ids=())
    kw = dict(num_gpu_blocks=24, block_size=8, max_num_seqs=6, max_model_len=128,
              preemption_mode=mode, enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=32)
    plain = LLM.from_params(config, params, NoTokenizer(), **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    _poison(spec)  # a read of a slot no table names for that position changes tokens
    got_plain, got_spec = _generate(plain, prompts, sp), _generate(spec, prompts, sp)
    assert [o[0] for o in got_plain] == want
    assert got_spec == got_plain
    st = spec.engine.get_stats()
    assert st.spec_num_accepted_tokens > 0 and st.spec_num_draft_tokens > st.spec_num_accepted_tokens
    assert st.num_preemptions_total > 0
    assert st.num_steps < plain.engine.get_stats().num_steps  # drafts saved steps
    assert len(st.spec_accepted_per_position) == 4
    assert st.spec_accepted_per_position[0] >= st.spec_accepted_per_position[-1]
    assert 1 < st.spec_mean_accepted_length <= 5
    assert_pool_whole(spec)
    # Again on the same engines: prefix-cache hits must never return draft KV.
    assert _generate(spec, prompts, sp) == got_plain
    assert_pool_whole(spec)


def test_seeded_sampling_is_identical(tiny):
    """Temperature, top-k/top-p, penalties, n=2: with per-request seeds every token equals the
    unspeculated run's, accepted drafts included."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 4, seed=1)
    sps = [SamplingParams(temperature=0.7, top_k=12, top_p=0.9, seed=100 + i, max_tokens=30,
                          ignore_eos=True, n=2, repetition_penalty=1.1 if i % 2 else 1.0,
                          presence_penalty=0.2 if i == 2 else 0.0, logprobs=2)
           for i in range(len(prompts))]
    kw = dict(num_gpu_blocks=48, block_size=8, max_num_seqs=8, max_model_len=128)
    plain = LLM.from_params(config, params, NoTokenizer(), **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    a = plain.generate([{"prompt_token_ids": p} for p in prompts], sps)
    b = spec.generate([{"prompt_token_ids": p} for p in prompts], sps)
    for ra, rb in zip(a, b, strict=True):
        for oa, ob in zip(ra.outputs, rb.outputs, strict=True):
            assert oa.token_ids == ob.token_ids
            # The sampled token's logprob: same value (a draft row runs in a multi-token
            # step, so the logits differ in rounding only, as do near-tied top-k orders).
            for t, da, db in zip(oa.token_ids, oa.logprobs, ob.logprobs, strict=True):
                assert abs(da[t] - db[t]) < 1e-4
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_pool_whole(spec)


def test_unseeded_distribution_equals_the_targets(tiny):
    """Two-sample chi-square on the 2nd, 3rd and 4th sampled tokens (the positions drafts
    cover), 600 samples each, different engine seeds so the runs share no random draws. The
    prompt holds every token once, so every step has a draft (what followed the last token in
    the prompt), and the random model rarely continues it: most drafts are rejected and the
    residual rule is what is tested. Threshold p < 1e-4 per test: a false failure about once
    in 3 300 runs of the three."""
    from scipy.stats import chi2_contingency

    config, params = tiny
    prompt = [int(t) for t in np.random.default_rng(5).permutation(np.arange(3, 96))]
    sp = SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, n=8)
    reps = 75  # 75 requests x n=8 = 600 samples

    def samples(spec: dict | None, seed: int) -> np.ndarray:
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=160, block_size=8,
                              max_num_seqs=16, max_model_len=128, seed=seed,
                              speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": prompt}] * reps, sp)
        if spec:
            st = llm.engine.get_stats()
            assert st.spec_num_draft_tokens > 1000 and st.spec_acceptance_rate < 0.5
        assert_pool_whole(llm)
        return np.array([o.token_ids for r in outs for o in r.outputs])

    plain, spec = samples(None, 1), samples(SPEC, 2)
    for pos in (1, 2, 3):
        vocab = sorted(set(plain[:, pos]) | set(spec[:, pos]))
        table = np.array([[np.sum(x[:, pos] == v) for v in vocab] for x in (plain, spec)])
        table = table[:, table.sum(axis=0) >= 5]  # chi-square needs populated cells
        _, p, _, _ = chi2_contingency(table)
        assert p > 1e-4, (pos, p, table)


def test_hybrid_model_greedy_equals_plain():
    """Gemma 3 config (two local, one global layer, window 8): drafts are trimmed per KV-cache
    group, local groups release behind the window."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        write_family("gemma3", Path(tmp))
        config, params, _ = load_model(tmp, dtype="float32")
    prompts = _prompts(config.vocab_size, 6, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(num_gpu_blocks=60, block_size=8, max_num_seqs=4, max_model_len=128,
              enable_prefix_caching=True)
    plain = LLM.from_params(config, params, NoTokenizer(), **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    assert _generate(spec, prompts, sp) == _generate(plain, prompts, sp)
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_pool_whole(spec)


def test_abort_mid_speculation_returns_every_block(tiny):
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                          max_model_len=128, speculative_config=SPEC)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(_prompts(config.vocab_size, 4, seed=3)):
        eng.add_request(str(i), None, sp, prompt_token_ids=p)
    for _ in range(6):
        eng.step()
    assert eng.get_stats().spec_num_draft_tokens > 0
    eng.abort_request(["0", "2"])
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(llm)


def _poison_all_but_computed(llm: LLM, value: float = 1e3) -> int:
    """Overwrite every KV slot except positions < num_computed_tokens of live sequences'
    tables and blocks in the prefix cache: rolled-back drafts' slots, trimmed blocks and free
    uncached blocks. Returns how many slots past a live sequence's computed length were
    poisoned (rolled-back drafts)."""
    eng = llm.engine
    r, bm, bs = eng.runner, eng.block_manager, eng.runner.block_size
    keep = np.zeros((r.num_gpu_blocks, bs), bool)
    for b in range(r.num_gpu_blocks):  # published full blocks: a later hit reads them
        keep[b] = bm.gpu.entry_of(b) is not None
    past = 0
    for g in eng.scheduler.running:
        for s in g.seqs:
            if s.is_finished() or bm.is_swapped(s):
                continue
            table = bm.get_block_table(s)
            n = s.num_computed_tokens
            for pos in range(n):
                keep[table[pos // bs], pos % bs] = True
            past += len(table) * bs - n
    m = jnp.asarray(keep)[None, None, :, :, None]
    r.k_cache = jnp.where(m, r.k_cache, value).astype(r.k_cache.dtype)
    r.v_cache = jnp.where(m, r.v_cache, -value).astype(r.v_cache.dtype)
    return past


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_rolled_back_slots_are_never_read(tiny, mode, caching):
    """After every step, everything but the KV of computed positions and of cached blocks is
    poisoned (the slots of rejected drafts, trimmed and free blocks): the tokens still equal
    plain decoding, so no step reads a rolled-back draft's KV, and no cached block holds one
    (a recompute-preempted request hits its own published blocks when it comes back)."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 6, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    kw = dict(num_gpu_blocks=20, block_size=8, max_num_seqs=4, max_model_len=128,
              preemption_mode=mode, enable_prefix_caching=caching)
    want = _generate(LLM.from_params(config, params, NoTokenizer(), **kw), prompts, sp)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), None, sp, prompt_token_ids=p)
    got, poisoned = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = [o.outputs[0].token_ids]
        poisoned += _poison_all_but_computed(spec)
    assert [got[str(i)] for i in range(len(prompts))] == want
    st = eng.get_stats()
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens > 0  # rejections happened
    assert st.num_preemptions_total > 0 and poisoned > 0
    assert (eng.block_manager.gpu.num_cached_blocks() > 0) is caching
    assert_pool_whole(spec)


def test_stops_inside_accepted_drafts(tiny):
    """max_tokens and stop ids cut a step's accepted tokens where plain decoding stops."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 6, seed=4)
    kw = dict(num_gpu_blocks=64, block_size=8, max_model_len=128)
    plain = LLM.from_params(config, params, NoTokenizer(), **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    base = _generate(plain, prompts, SamplingParams(temperature=0, max_tokens=30,
                                                    ignore_eos=True))
    for n in (1, 7, 13):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert _generate(spec, prompts, sp) == [[o[0][:n]] for o in base]
    stop = base[0][0][9]  # a token the first request emits mid-run
    sp = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    assert _generate(spec, prompts, sp) == _generate(plain, prompts, sp)
    assert_pool_whole(spec)


def test_beam_search_is_refused(tiny):
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                          max_model_len=64, speculative_config=SPEC)
    with pytest.raises(ValueError, match="use_beam_search"):
        llm.engine.add_request("b", None, SamplingParams(use_beam_search=True, best_of=2,
                                                         temperature=0, max_tokens=4),
                               prompt_token_ids=[5, 6, 7])
    assert not llm.engine.has_unfinished_requests()


def test_metrics_reach_prometheus_grpc_and_the_cli(tiny):
    from prometheus_client import generate_latest

    from pagedjax.cli import build_parser, serve_options
    from pagedjax.serving.metrics import ServingMetrics
    from pagedjax.serving.proto import pagedjax_pb2 as pb

    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                          max_model_len=128, speculative_config=SPEC)
    _generate(llm, _prompts(config.vocab_size, 3, seed=6),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    st = llm.engine.get_stats()
    assert st.spec_num_accepted_tokens == sum(st.spec_accepted_per_position) > 0
    # Drafted per position: position 0 of every proposal, fewer further out (n-gram
    # proposals stop where the match does); the rate per position is accepted / drafted.
    assert st.spec_drafted_per_position[0] == st.spec_num_drafts
    assert sum(st.spec_drafted_per_position) == st.spec_num_draft_tokens
    assert list(st.spec_drafted_per_position) == sorted(st.spec_drafted_per_position, reverse=True)
    assert all(0 <= a <= d for a, d in zip(st.spec_accepted_per_position,
                                           st.spec_drafted_per_position, strict=True))
    assert st.spec_acceptance_rate_per_position[0] == pytest.approx(
        st.spec_accepted_per_position[0] / st.spec_drafted_per_position[0])
    m = ServingMetrics()
    m.observe_stats(st)
    text = generate_latest(m.registry).decode()
    assert f"pagedjax_spec_decode_num_draft_tokens {float(st.spec_num_draft_tokens)}" in text
    assert f"pagedjax_spec_decode_num_accepted_tokens {float(st.spec_num_accepted_tokens)}" in text
    assert 'pagedjax_spec_decode_num_accepted_tokens_per_pos{position="0"} ' \
           f"{float(st.spec_accepted_per_position[0])}" in text
    assert 'pagedjax_spec_decode_num_draft_tokens_per_pos{position="0"} ' \
           f"{float(st.spec_drafted_per_position[0])}" in text
    msg = pb.Stats(spec_num_draft_tokens=st.spec_num_draft_tokens,
                   spec_accepted_per_position=list(st.spec_accepted_per_position))
    assert pb.Stats.FromString(msg.SerializeToString()).spec_accepted_per_position == \
        list(st.spec_accepted_per_position)
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"num_speculative_tokens": 2}'])
    from pagedjax.config import EngineConfig

    ec = EngineConfig(**serve_options(args).engine_kwargs)
    assert ec.speculative_config.num_speculative_tokens == 2


def test_a_speculative_server_reports_its_counters(tiny, tmp_path):
    """`pagedjax serve --speculative-config ...` end to end: requests over gRPC, then the
    server's own gRPC Stats and `/metrics` (pagedjax_* and vllm:* names) carry the engine's
    speculative counters."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pagedjax.serving.client import Client
    from tests.serving.fuzz_support import ToyTokenizer
    from tests.serving.inproc import InProcessServer

    config, params = tiny
    llm = LLM.from_params(config, params, ToyTokenizer(config.vocab_size), model_name="tiny",
                          num_gpu_blocks=40, block_size=8, max_model_len=128,
                          speculative_config=SPEC)
    srv = InProcessServer(llm.engine, tmp_path, http_port=0).start()
    try:
        greedy = {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True}
        with Client(srv.target, timeout=60) as c:
            c.wait_ready(60)
            for p in _prompts(config.vocab_size, 3, seed=12):
                c.generate(p, greedy)
            pb_stats = c.stats()
        st = llm.engine.get_stats()
        assert st.spec_num_accepted_tokens > 0
        assert pb_stats.spec_num_draft_tokens == st.spec_num_draft_tokens
        assert pb_stats.spec_num_accepted_tokens == st.spec_num_accepted_tokens
        assert pb_stats.spec_num_drafts == st.spec_num_drafts
        assert list(pb_stats.spec_accepted_per_position) == list(st.spec_accepted_per_position)
        assert list(pb_stats.spec_drafted_per_position) == list(st.spec_drafted_per_position)
        samples = {}
        for port in (srv.ports["metrics_port"], srv.ports["http_port"]):
            url = f"http://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    samples[(s.name, s.labels.get("position"))] = s.value
        assert samples[("pagedjax_spec_decode_num_draft_tokens", None)] == st.spec_num_draft_tokens
        assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == st.spec_num_draft_tokens
        assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == \
            st.spec_num_accepted_tokens
        assert samples[("vllm:spec_decode_num_drafts_total", None)] == st.spec_num_drafts
        for j, a in enumerate(st.spec_accepted_per_position):
            assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] == a
            assert samples[("pagedjax_spec_decode_num_draft_tokens_per_pos", str(j))] == \
                st.spec_drafted_per_position[j]
    finally:
        assert srv.close() == 0
    assert_pool_whole(llm)


# -- draft-model proposer ------------------------------------------------------------------

@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """The llama3 family config of the HF goldens as the target; the same checkpoint, and
    the mistral family's (same 128-token vocabulary, unrelated weights) as drafts."""
    out = {}
    for name in ("llama3", "mistral"):
        path = tmp_path_factory.mktemp(name)
        write_family(name, path)
        out[name] = path
    return out


def _draft_llm(family_dirs, draft: str | None, **kw) -> LLM:
    config, params, _ = load_model(family_dirs["llama3"], dtype="float32")
    spec = None if draft is None else {
        "method": "draft_model", "model": str(family_dirs[draft]), "num_speculative_tokens": 3}
    return LLM.from_params(config, params, NoTokenizer(), block_size=8, max_model_len=128,
                           speculative_config=spec, **kw)


def _assert_draft_pool_whole(llm: LLM) -> None:
    d = llm.engine.draft
    d.release(list(d._seqs))
    assert d.pool.get_num_free() == d.runner.num_gpu_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_greedy_equals_plain(family_dirs, mode):
    kw = dict(num_gpu_blocks=30, max_num_seqs=6, preemption_mode=mode,
              enable_prefix_caching=True)
    plain, spec = _draft_llm(family_dirs, None, **kw), _draft_llm(family_dirs, "mistral", **kw)
    prompts = _prompts(128, 8, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert _generate(spec, prompts, sp) == _generate(plain, prompts, sp)
    st = spec.engine.get_stats()
    assert st.spec_num_draft_tokens > 100 and st.num_preemptions_total > 0
    assert st.spec_acceptance_rate < 0.9  # a poor draft: the residual path is exercised
    assert_pool_whole(spec)
    _assert_draft_pool_whole(spec)


def test_draft_equal_to_target_accepts_every_token(family_dirs):
    spec = _draft_llm(family_dirs, "llama3", num_gpu_blocks=64)
    plain = _draft_llm(family_dirs, None, num_gpu_blocks=64)
    prompts = _prompts(128, 4, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=31, ignore_eos=True)
    assert _generate(spec, prompts, sp) == _generate(plain, prompts, sp)
    st = spec.engine.get_stats()
    assert st.spec_num_draft_tokens > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    assert st.spec_accepted_per_position[0] == st.spec_num_drafts  # no step rejected any
    assert st.spec_mean_accepted_length > 3.5  # k = 3 (fewer only next to max_tokens) + 1
    assert_pool_whole(spec)


def test_draft_model_seeded_and_unseeded_sampling(family_dirs):
    """Seeded: identical tokens; unseeded: chi-square against plain decoding (p < 1e-4 per
    position, as above) with the unrelated draft, whose drafts are mostly rejected."""
    from scipy.stats import chi2_contingency

    prompts = _prompts(128, 4, seed=9)
    sps = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=20,
                          ignore_eos=True) for i in range(4)]
    kw = dict(num_gpu_blocks=64, max_num_seqs=8)
    plain, spec = _draft_llm(family_dirs, None, **kw), _draft_llm(family_dirs, "mistral", **kw)
    assert _generate(spec, prompts, sps) == _generate(plain, prompts, sps)

    sp = SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, n=8)

    def samples(draft, seed):
        llm = _draft_llm(family_dirs, draft, num_gpu_blocks=200, max_num_seqs=16, seed=seed)
        outs = llm.generate([{"prompt_token_ids": prompts[0]}] * 75, sp)
        if draft:  # both paths of the rule run: accepted and rejected drafts
            st = llm.engine.get_stats()
            assert st.spec_num_draft_tokens > 1000
            assert 0.02 < st.spec_acceptance_rate < 0.6, st.spec_acceptance_rate
        return np.array([o.token_ids for r in outs for o in r.outputs])

    a, b = samples(None, 1), samples("mistral", 2)
    for pos in (1, 2, 3):
        vocab = sorted(set(a[:, pos]) | set(b[:, pos]))
        table = np.array([[np.sum(x[:, pos] == v) for v in vocab] for x in (a, b)])
        table = table[:, table.sum(axis=0) >= 5]
        assert chi2_contingency(table)[1] > 1e-4, (pos, table)


def test_draft_model_config_errors(family_dirs, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM.from_params(*load_model(family_dirs["llama3"], dtype="float32")[:2], NoTokenizer(),
                        speculative_config={"method": "draft_model"})


def test_stop_strings_stop_at_the_same_token(tiny):
    """A stop string completed by an accepted draft ends the sequence there: the tokens the
    same step accepted after it are never appended (NoTokenizer's text is the ids joined)."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 6, seed=4)
    kw = dict(num_gpu_blocks=64, block_size=8, max_model_len=128)
    plain = LLM.from_params(config, params, NoTokenizer(), **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC, **kw)
    base = _generate(plain, prompts, SamplingParams(temperature=0, max_tokens=30,
                                                    ignore_eos=True))
    for i in (3, 8):
        stop = " ".join(map(str, base[0][0][i : i + 2]))  # two tokens the first request emits
        sp = SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
        a = plain.generate([{"prompt_token_ids": p} for p in prompts], sp)
        b = spec.generate([{"prompt_token_ids": p} for p in prompts], sp)
        for x, y in zip(a, b, strict=True):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert x.outputs[0].text == y.outputs[0].text
            assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        assert a[0].outputs[0].finish_reason == "stop"
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_pool_whole(spec)


def test_speculative_steps_use_small_token_buckets(tiny):
    """A lone sequence's 1 + k tokens are not padded (to the 16-token prefill minimum, or to
    a power of two): padded tokens cost full compute. Larger steps take powers of two."""
    from pagedjax.worker.shapes import ShapePlan

    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_model_len=128, speculative_config=SPEC)
    plan = llm.engine.runner.shape_plan
    assert plan.min_tokens == 5 and plan.mixed(5, 1, 0)[0] == 5
    assert plan.mixed(2, 1, 0)[0] == 5 and plan.mixed(6, 2, 0)[0] == 8
    assert plan.mixed(10, 2, 0)[0] == 16 and plan.token_buckets[:3] == [5, 8, 16]
    assert plan.mixed(5, 1, 0) == (5, 8, 8)  # sequences padded to a sampler batch size
    assert (5, 8, plan.max_blocks_per_seq, 8, False) in plan.step_shapes()
    assert ShapePlan(8, 64, 16, True).mixed(5, 1, 0)[0] == 16  # without speculation
    plain = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                            max_model_len=128)
    assert plain.engine.runner.shape_plan.min_tokens == 16


# ---- composition with async scheduling ------------------------------------------------------
def _pending_drafts(llm: LLM) -> int:
    """Accepted drafts that followed a guess of a token still on the device (and the guess
    was proposed at all)."""
    assert llm.engine.scheduler.num_guessed_drafts > 0
    return llm.engine.num_guessed_accepted


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_greedy_equals_plain(tiny, mode):
    """Async scheduling on: steps without drafts overlap the host with the device, drafted
    steps wait for their results, and drafts may follow a guess of the token still on the
    device. Outputs equal plain decoding with async scheduling off, under preemption, prefix
    caching, chunked prefill and a poisoned cache; drafts that followed a pending token were
    verified and some accepted."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 8, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(num_gpu_blocks=24, block_size=8, max_num_seqs=6, max_model_len=128,
              preemption_mode=mode, enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=32)
    plain = LLM.from_params(config, params, NoTokenizer(), async_scheduling=False, **kw)
    spec = LLM.from_params(config, params, NoTokenizer(), async_scheduling=True,
                           speculative_config={**SPEC, "prompt_lookup_min": 2}, **kw)
    assert spec.engine.runner.feed_tokens
    _poison(spec)
    want = _generate(plain, prompts, sp)
    assert _generate(spec, prompts, sp) == want
    st = spec.engine.get_stats()
    assert st.spec_num_accepted_tokens > 0 and st.num_preemptions_total > 0
    assert _pending_drafts(spec) > 0
    assert st.num_steps < plain.engine.get_stats().num_steps
    assert_pool_whole(spec)
    assert _generate(spec, prompts, sp) == want  # prefix-cache hits after async speculation
    assert_pool_whole(spec)


class _Oracle:
    """A proposer that knows each sequence's future (a plain run's outputs): it drafts only
    while the sequence's last token is still on the device, so every drafted step follows a
    guessed pending token, and it spoils every third proposal's last draft so that
    rejections happen too."""

    def __init__(self, k: int, expected: dict[tuple[int, ...], list[list[int]]]) -> None:
        self.k, self.expected, self.calls = k, expected, 0

    def propose_for(self, seq, k: int) -> list[int]:
        if not seq.num_pending:
            return []
        out = list(seq.output_token_ids)
        for want in self.expected[tuple(seq.prompt_token_ids)]:
            if want[: len(out)] == out:
                drafts = want[len(out) : len(out) + k]
                self.calls += 1
                if self.calls % 3 == 0 and len(drafts) > 1:
                    drafts[-1] = (drafts[-1] + 1) % 96
                return drafts
        return []


def test_async_scheduling_guessed_drafts_keep_seeded_sampling_identical(tiny):
    """Seeded sampling with penalties, min_tokens and n=2 under async scheduling, with drafts
    that follow a guessed pending token (`_Oracle`): a draft row counts the pending token
    before it (a placeholder history column written on the device, the random key's step,
    min_tokens), so every token equals plain decoding's."""
    config, params = tiny
    prompts = _prompts(config.vocab_size, 4, seed=4)
    sps = [SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=200 + i, max_tokens=30,
                          ignore_eos=True, n=2 if i == 3 else 1,
                          repetition_penalty=1.3 if i % 2 else 1.0,
                          frequency_penalty=0.5 if i == 2 else 0.0, min_tokens=5)
           for i in range(len(prompts))]
    kw = dict(num_gpu_blocks=48, block_size=8, max_num_seqs=8, max_model_len=128)
    plain = LLM.from_params(config, params, NoTokenizer(), async_scheduling=False, **kw)
    want = _generate(plain, prompts, sps)
    spec = LLM.from_params(config, params, NoTokenizer(), speculative_config=SPEC,
                           async_scheduling=True, **kw)
    spec.engine.scheduler.proposer = _Oracle(4, {tuple(p): w for p, w in zip(prompts, want)})
    assert _generate(spec, prompts, sps) == want
    st = spec.engine.get_stats()
    assert spec.engine.num_guessed_accepted > 40  # most of the outputs came from drafts
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # spoiled drafts rejected
    assert_pool_whole(spec)


def test_async_scheduling_with_a_draft_model(family_dirs):
    kw = dict(num_gpu_blocks=30, max_num_seqs=6, preemption_mode="recompute",
              enable_prefix_caching=True)
    plain = _draft_llm(family_dirs, None, async_scheduling=False, **kw)
    spec = _draft_llm(family_dirs, "llama3", async_scheduling=True, **kw)
    prompts = _prompts(128, 6, seed=10)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert _generate(spec, prompts, sp) == _generate(plain, prompts, sp)
    st = spec.engine.get_stats()
    # The draft equals the target: every draft is accepted, the guessed ones included.
    assert _pending_drafts(spec) > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0
    assert_pool_whole(spec)
    _assert_draft_pool_whole(spec)
