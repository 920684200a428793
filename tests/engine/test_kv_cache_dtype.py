"""Quantized KV caches through the engine (`EngineConfig.kv_cache_dtype`).

- Scheduling never changes what a quantized cache holds: greedy outputs under recompute and
  swap preemption, prefix caching and chunked prefill from a poisoned cache equal the same
  quantized engine run with room for everything, and the pool is whole.
- The profiler buys 4x the blocks of an fp32 cache in the same budget; `EngineStats` reports
  bytes per token, cache and weight bytes.
- Calibration: scales follow the weights (a weight swap recalibrates); the granularities.
- int8 on CPU keeps per-token factors by default ("auto"): they survive preemption, swap and
  prefix hits like the values, cost 4 bytes per token and head, and halve the quality loss.
- Quality on the demo model (teacher-forced next-token agreement with the fp32 cache over
  the bench prompts' greedy continuations): bounds from measurement, so a broken scale or
  kernel (which gives near-random tokens) fails them.
- Configuration errors name the field.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pallas_kernels.kv_quant import factor_slots
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.engine.test_hybrid_kv import _poison, _workload
from tests.model.test_families import write_family
from tests.parallel.tp_script import NoTokenizer, prompts_for, tiny_model

DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
# (kv_cache_dtype, kv_scale_granularity): "auto" is per-token factors for int8 on CPU.
SETTINGS = [("int8", "auto"), ("int8", "per_channel"), ("fp8_e4m3", "auto"),
            ("fp8_e5m2", "auto")]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _greedy(llm: LLM, prompts, n: int = 24):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("dtype,gran", SETTINGS)
def test_scheduling_does_not_change_quantized_outputs(tiny, dtype, gran, mode):
    """Per-token factors live in the blocks' own factor slots: swap, copy and prefix hits
    carry them (the poison below fills every factor no token wrote with ~3e38)."""
    config, params = tiny
    prompts = prompts_for(config.vocab_size)
    kw = dict(kv_cache_dtype=dtype, kv_scale_granularity=gran)
    roomy = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                            max_num_seqs=8, **kw)
    want = _greedy(roomy, prompts)
    tight = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=12, block_size=8,
                            max_num_seqs=4, preemption_mode=mode, enable_prefix_caching=True,
                            enable_chunked_prefill=True, max_num_batched_tokens=16, **kw)
    assert tight.engine.runner.k_cache.dtype == jax.numpy.dtype(
        {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[dtype])
    factors = (dtype, gran) == ("int8", "auto")
    assert tight.engine.runner.token_scales == factors
    assert tight.engine.runner.k_cache.shape[0] == config.num_layers + (
        factor_slots(config.num_layers, config.head_dim) if factors else 0)
    _poison_quantized(tight)
    assert _greedy(tight, prompts) == want
    st = tight.engine.get_stats()
    assert st.num_preemptions_total > 0
    assert_pool_whole(tight)
    # Again: prefix-cache hits read the quantized blocks the first run left.
    assert _greedy(tight, prompts) == want
    assert tight.engine.get_stats().num_preemptions_total > st.num_preemptions_total
    assert_pool_whole(tight)


def _poison_quantized(llm: LLM) -> None:
    """Every stored byte 0x7F: int8 127 (the largest value), FP8's NaN."""
    r = llm.engine.runner
    bits = np.full(r.k_cache.shape, 0x7F, np.uint8).view(r.k_cache.dtype)
    r.k_cache = jax.device_put(bits, r.k_cache.sharding)
    r.v_cache = jax.device_put(bits.copy(), r.v_cache.sharding)


def test_quantized_hybrid_model(tmp_path):
    """Gemma 3's local and global layers share cache slots (hybrid KV groups); scales are the
    model layer's, not the slot's. Preempted from a poisoned cache equals the roomy run."""
    from models.loader import load_model

    write_family("gemma3", tmp_path)
    config, params, _ = load_model(tmp_path, dtype="float32")
    prompts, _ = _workload(config, 3, n=8)
    roomy = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=200, block_size=8,
                            max_model_len=128, kv_cache_dtype="int8")
    assert roomy.engine.runner.kv_layout.hybrid
    want = _greedy(roomy, prompts, 30)
    tight = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=40, block_size=8,
                            max_num_seqs=6, max_model_len=128, preemption_mode="swap",
                            enable_prefix_caching=True, kv_cache_dtype="int8")
    _poison(tight, 7)  # junk int8 everywhere no table names
    assert _greedy(tight, prompts, 30) == want
    assert tight.engine.get_stats().num_preemptions_total > 0
    assert_pool_whole(tight)


def test_profiler_and_memory_stats(tiny):
    config, params = tiny
    kw = dict(block_size=8, cpu_kv_cache_gb=0.001)
    full = LLM.from_params(config, params, NoTokenizer(), **kw).engine
    q8 = LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8",
                         kv_scale_granularity="per_channel", **kw).engine
    q8t = LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8", **kw).engine
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    # Factors: 4 bytes per (layer, head) of K and of V, in whole factor slots.
    slots = config.num_layers + factor_slots(config.num_layers, config.head_dim)
    with_factors = per_token * slots // config.num_layers
    budget = int(0.001 * (1 << 30))
    assert full.runner.num_gpu_blocks == budget // (4 * per_token * 8)
    assert q8.runner.num_gpu_blocks == budget // (per_token * 8)  # 1 byte vs fp32's 4
    assert q8t.runner.num_gpu_blocks == budget // (with_factors * 8)
    a, b, c = full.get_stats(), q8.get_stats(), q8t.get_stats()
    assert (a.kv_cache_dtype, a.kv_bytes_per_token) == ("float32", 4 * per_token)
    assert (b.kv_cache_dtype, b.kv_bytes_per_token) == ("int8", per_token)
    assert (c.kv_cache_dtype, c.kv_bytes_per_token) == ("int8", with_factors)
    assert b.kv_cache_bytes == b.kv_bytes_per_token * 8 * q8.runner.num_gpu_blocks
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert a.weights_bytes == b.weights_bytes == weights


def test_scales_follow_the_weights_and_granularity(tiny):
    config, params = tiny
    eng = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                          kv_cache_dtype="int8").engine
    s = eng.kv_scales
    assert s.shape == (config.num_layers, 2, config.num_kv_heads, config.head_dim)
    assert (s > 0).all() and len(np.unique(s[0, 0])) > config.num_kv_heads  # per channel
    # Doubled K/V projections: the first layer's K and V (computed from the embeddings)
    # double, so do its calibrated scales; later layers see other inputs and change too.
    doubled = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 2 if any(getattr(k, "key", "") in ("k_proj", "v_proj")
                                     for k in path) else x, params)
    eng.update_params(doubled)
    np.testing.assert_allclose(eng.kv_scales[0], 2 * s[0], rtol=1e-5)
    assert not np.allclose(eng.kv_scales[1:], s[1:])
    for gran, distinct in (("per_head", config.num_kv_heads), ("per_tensor", 1)):
        e = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                            kv_cache_dtype="int8", kv_scale_granularity=gran).engine
        assert len(np.unique(e.kv_scales[0, 0])) == distinct
        np.testing.assert_allclose(e.kv_scales.max(axis=(2, 3)), s.max(axis=(2, 3)))


def test_no_compiles_after_warmup(tiny):
    """The scales ride in the step's metadata as a device array: warm-up covers every step."""
    from pagedjax.worker.compile_stats import num_backend_compiles

    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=12, block_size=8,
                          max_num_seqs=4, preemption_mode="swap", kv_cache_dtype="int8",
                          warmup=True)
    before = num_backend_compiles()
    _greedy(llm, prompts_for(config.vocab_size))
    assert num_backend_compiles() == before
    assert llm.engine.get_stats().num_preemptions_total > 0


@pytest.mark.parametrize("field,value", [("kv_cache_dtype", "int4"),
                                         ("kv_scale_granularity", "per_block")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


# Teacher-forced top-1 disagreement with the fp32 cache on the demo model, measured on this
# test's workload (16 chat prompts x 48 greedy tokens, 768 positions): int8 with per-token
# factors (the CPU default) 1.2 %, mean |dlogprob| 0.009; per-channel scales: int8 2.2-2.5 %,
# FP8 e4m3 4.0 %, e5m2 8.7 % (mean |dlogprob| 0.029 / 0.052 / 0.116). SmolLM2-135M is small
# and its near-ties many; bounds with headroom (the factors' logprob bound is half of what
# per-channel scales reach: it fails if the factors stop working).
QUALITY = {("int8", "auto"): (0.02, 0.015), ("int8", "per_channel"): (0.04, 0.04),
           ("fp8_e4m3", "auto"): (0.08, 0.09), ("fp8_e5m2", "auto"): (0.15, 0.18)}


@pytest.fixture(scope="module")
def demo_continuations(demo_model, demo_tokenizer):
    from bench.offline_throughput import PROMPTS

    config, params = demo_model
    base = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=160, block_size=16,
                           max_model_len=256, layer_loop="scan")
    outs = base.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                     SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    starts = [len(o.prompt_token_ids) for o in outs]
    return seqs, starts, _teacher_forced(base, seqs, starts)


def _teacher_forced(llm: LLM, seqs, starts):
    """Top-1 prediction and the logprob of the given token at every continuation position."""
    res = llm.generate([{"prompt_token_ids": s} for s in seqs],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    tops, lps = [], []
    for r, s, st in zip(res, seqs, starts, strict=True):
        for i in range(st, len(s)):
            d = r.prompt_logprobs[i]  # token id -> logprob
            tops.append(max(d, key=d.get))
            lps.append(d[s[i]])
    return np.asarray(tops), np.asarray(lps)


@pytest.mark.parametrize("dtype,gran", SETTINGS)
def test_quality_against_the_fp32_cache(demo_model, demo_tokenizer, demo_continuations, dtype,
                                        gran):
    config, params = demo_model
    seqs, starts, (tops, lps) = demo_continuations
    llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=160, block_size=16,
                          max_model_len=256, layer_loop="scan", kv_cache_dtype=dtype,
                          kv_scale_granularity=gran)
    t, lp = _teacher_forced(llm, seqs, starts)
    disagree, dlogprob = float(np.mean(t != tops)), float(np.mean(np.abs(lp - lps)))
    top_bound, lp_bound = QUALITY[dtype, gran]
    assert disagree <= top_bound and dlogprob <= lp_bound, (dtype, disagree, dlogprob)
    assert disagree > 0  # the cache really is quantized (fp32 agrees exactly)


def test_token_factors_where_they_run(tiny):
    """"per_token" asks for factors and names the setting where they cannot run (FP8, the
    Pallas kernels); "auto" takes them only where they run."""
    config, params = tiny
    kw = dict(num_gpu_blocks=16, block_size=8)
    with pytest.raises(ValueError, match="kv_scale_granularity.*int8"):
        LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="fp8_e4m3",
                        kv_scale_granularity="per_token", **kw)
    with pytest.raises(ValueError, match="kv_scale_granularity.*Pallas"):
        LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8",
                        kv_scale_granularity="per_token", attention_backend="pallas", **kw)
    for backend, factors in ((None, True), ("xla", True), ("pallas", False)):
        r = LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8",
                            attention_backend=backend, **kw).engine.runner
        assert r.token_scales == factors, backend
    xla = LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8",
                          kv_scale_granularity="per_token", attention_backend="xla", **kw)
    native = LLM.from_params(config, params, NoTokenizer(), kv_cache_dtype="int8", **kw)
    prompts = prompts_for(config.vocab_size)
    assert _greedy(xla, prompts) == _greedy(native, prompts)  # two readers, one cache format
