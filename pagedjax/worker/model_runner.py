"""Owns the device state (params, paged KV cache) and runs one jitted step.

The step is `model(...)` with `PagedAttention`: K/V written into the cache in place (the
cache arguments are donated and the kernels alias them), logits computed only for the rows
that are sampled. Block copies (copy-on-write) and swaps run as separate small jitted
calls before the step, also in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.decoder import DecoderLM, unstack_layers
from pagedjax.config import EngineConfig
from pagedjax.core.kv_groups import KVGroupLayout, plan_kv_groups
from pagedjax.parallel import multihost
from pagedjax.parallel.attention import ShardedPagedAttention, sharded_copy_blocks
from pagedjax.parallel.experts import ExpertParallelMoE
from pagedjax.parallel.mesh import (
    AXIS,
    abstract_sharded_params,
    cache_sharding,
    make_mesh,
    replicated,
    shard_params,
    sharded_config,
    validate_tp,
    vocab_sharded,
)
from pagedjax.worker import huge_pages
from pagedjax.worker.device_histories import DeviceHistories
from pagedjax.worker.device_tables import DeviceTables, apply_writes, gather_rows
from pagedjax.worker.device_tables import capacity as table_capacity
from pagedjax.worker.host_heap import keep_freed_memory
from pagedjax.worker.huge_pages import place_on_huge_pages
from pagedjax.worker.paged_attention import PagedAttention, PagedMeta
from pagedjax.worker.shapes import MIN_PREFILL_TOKENS, ShapePlan
from pagedjax.worker.step_inputs import StepInputs, bucket
from pallas_kernels import copy_blocks, swap_in, swap_out
from pallas_kernels.backend import ENV_BACKEND, cost_follows_length
from pallas_kernels.kv_quant import (
    PER_TOKEN_BACKENDS,
    PER_TOKEN_DTYPE,
    factor_slots,
    is_quantized,
    resolve_kv_cache_dtype,
    scales_from_amax,
)

logger = logging.getLogger(__name__)


LAYER_LOOP_ENV = "PAGEDJAX_LAYER_LOOP"


def read_in_place(tree):
    """`jax.device_get` for arrays on one CPU device: numpy views of their buffers."""
    return jax.tree.map(np.asarray, tree)


def resolve_layer_loop(choice: str | None, tp: int, devices=None) -> str:
    """`EngineConfig.layer_loop`, else $PAGEDJAX_LAYER_LOOP, else "unrolled" on GPUs (any
    TP: the fused projections are grouped per shard, `models.decoder.split_fused`) and on
    one CPU device, "scan" on several CPU devices.

    GPU: under `scan`, XLA slices each layer's weights out of the stacked parameters and
    materializes the slice before every GEMM (its Triton GEMM fusions cannot take a sliced
    operand), so the weights cross HBM three times a step. The first H100 run measured a
    Llama-3-8B decode step at 22-28 ms where reading the weights and KV once takes ~11-15 ms;
    the deviceless compile shows 436 MB of per-layer copies under `scan` and none unrolled
    (`tests/aot/test_step_memory.py`). One CPU device: 1.7x faster decode. The price is
    compile time (a 30-layer step shape in ~9 s on CPU instead of ~1 s; ~3x on GPU), so the
    test suite sets the variable to "scan" and tests the loop explicitly."""
    choice = choice or os.environ.get(LAYER_LOOP_ENV) or None
    if choice not in (None, "scan", "unrolled"):
        raise ValueError(f"{LAYER_LOOP_ENV}: must be 'scan' or 'unrolled'; got {choice!r}")
    if choice is None:
        choice = default_layer_loop((devices[0] if devices else jax.devices()[0]).platform, tp)
    return choice


def default_layer_loop(platform: str, tp: int) -> str:
    """The loop `resolve_layer_loop` picks when nothing is set (the AOT tier compiles it).
    Several CPU devices (tests, the TP benchmark) keep the scan for its compile time."""
    gpu = platform in ("gpu", "cuda", "rocm")
    return "unrolled" if gpu or (tp == 1 and platform == "cpu") else "scan"


ENV_FUSED_NORM = "PAGEDJAX_FUSED_NORM"


ENV_SCREENED_HEAD = "PAGEDJAX_SCREENED_HEAD"


def screened_head_setting() -> bool:
    """Whether greedy rows take their tokens from the bfloat16-screened LM head
    (``PAGEDJAX_SCREENED_HEAD``: 1 on, 0 off, unset / auto: where the native library has a
    vector path for it, AVX512-BF16 or AVX2 + FMA). The screen's tokens are exactly the
    float32 head's either way; its portable loop is slower than the float32 head (a batch-1
    step twice as slow on an AVX2 host before that host had a path of its own; with it, 0.97x
    at batch 1 and 1.07-1.13x batched: docs/v1-core.md "AVX2 hosts")."""
    v = os.environ.get(ENV_SCREENED_HEAD, "auto").lower()
    if v in ("0", "false", "off"):
        return False
    if v in ("1", "true", "on"):
        return True
    from pallas_kernels import cpu_native

    return cpu_native.available() and bool({"avx512bf16", "avx2_fma"}
                                           & cpu_native.compiled_isa())


def fused_norm_fn(attention_backend: str | None, tp: int, platform: str):
    """The model's residual add + RMSNorm (`DecoderLM.norm_fn`): the Pallas kernel
    (`pallas_kernels.add_rms_norm`) on one GPU with Pallas attention, the native kernel
    (`pallas_kernels.cpu_native.add_rms_norm_cpu`) on one CPU device when the library builds,
    None (XLA's add and norm) elsewhere. Why: on a GPU a norm at batch 1 is three small
    launches, two with the kernel (the deviceless H100 8B step: 582 -> 518 launches); on CPU
    XLA makes four thunks of each norm, ~38 us at 64 rows against ~25 for one native call
    (60 norms a step on the demo model; the native call up to 128 rows, XLA's past that:
    docs/v1-core.md, stop 83). Under tensor parallelism
    the partitioner cannot split a custom call (the hidden states are replicated there, so it
    would run whole on every device: unmeasured, so not chosen).
    ``$PAGEDJAX_FUSED_NORM``: ``1`` the Pallas kernel anywhere (interpreted off a GPU: the
    tests), ``0`` off, ``auto`` (default) the rule above."""
    choice = (os.environ.get(ENV_FUSED_NORM) or "auto").lower()
    if choice not in ("0", "1", "auto"):
        raise ValueError(f"{ENV_FUSED_NORM}={choice!r}; expected 0, 1 or auto")
    backend = (attention_backend or os.environ.get(ENV_BACKEND) or "pallas").lower()
    if choice == "auto" and tp == 1 and platform == "cpu":
        from pallas_kernels import cpu_native

        return cpu_native.add_rms_norm_cpu if cpu_native.available() else None
    on = choice == "1" or (choice == "auto" and tp == 1 and platform in ("gpu", "cuda", "rocm")
                           and backend == "pallas")
    if not on:
        return None
    from pallas_kernels.add_rms_norm import add_rms_norm

    return add_rms_norm


def resolve_async_scheduling(choice: bool | None, tp: int, devices=None) -> bool:
    """`EngineConfig.async_scheduling`; None: on with one device, where host work hidden
    behind the device step is time saved. On CPU too: the host thread competes with XLA's
    compute threads for the same cores, but on the 2-core Intel host it still gained 9.5 % at
    one sequence and 2.5 % at 64, and lost 0.8 % at 256 (within noise;
    `bench/results/cpu/async_scheduling.json`, `bench/offline_throughput.py --engines
    pagedjax-sync,pagedjax-async`). It was off on CPU after an AMD host measured no gain.
    Not supported under tensor parallelism (the multi-process step broadcast carries host
    token ids only). The paper's contiguous-cache baselines run it too (their block tables
    count the pending token since stop 35; before, they were forced synchronous)."""
    if choice and tp > 1:
        raise ValueError("async_scheduling: not supported with tensor_parallel_size > 1")
    if choice is None:
        choice = tp == 1
    return bool(choice)


def min_step_tokens(engine_config: EngineConfig) -> int:
    """Smallest token bucket of a multi-token step: a lone speculative sequence's 1 + k
    tokens when speculating (`ShapePlan.min_tokens`), else the prefill minimum."""
    sc = engine_config.speculative_config
    if sc is None:
        return MIN_PREFILL_TOKENS
    return min(MIN_PREFILL_TOKENS, max(2, 1 + sc.num_speculative_tokens))


def native_packed_matmul(tp: int, devices=None):
    """The kernel that multiplies by packed weights without a float copy of them
    (`models.qlinear.Linear`): on one CPU device the native one
    (`pallas_kernels.cpu_native.packed_matmul_cpu`, when the library builds), on one GPU the
    Pallas one (`pallas_kernels.packed_matmul`: XLA's own version materialises a bf16 copy of
    the weight for its GEMM). None under tensor parallelism, whose partitioner cannot split a
    custom call: XLA dequantizes there."""
    platform = (devices[0] if devices else jax.devices()[0]).platform
    if tp != 1:
        return None
    if platform == "cpu":
        from pallas_kernels import cpu_native

        return cpu_native.packed_matmul_cpu if cpu_native.available() else None
    if platform == "gpu":
        from pallas_kernels.packed_matmul import packed_matmul

        return packed_matmul
    return None


def _native_cpu() -> bool:
    from pallas_kernels import cpu_native

    return cpu_native.available()


def check_kv_dtype_on(kv_dtype, device) -> None:
    """FP8 caches need FP8 conversions in the kernels: NVIDIA GPUs from sm_89 (Ada, Hopper)
    on; an A100 (sm_80) is refused by name rather than failing inside Triton's compile. CPU
    decodes FP8 in software (the native kernel's tables, XLA's converts)."""
    d = jnp.dtype(kv_dtype)
    if not is_quantized(d) or d == jnp.int8 or device.platform != "gpu":
        return
    cc = getattr(device, "compute_capability", None)
    if cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9):
        raise ValueError(f"kv_cache_dtype: {d.name} needs compute capability 8.9 or newer "
                         f"(this GPU is {cc}); use 'int8' or 'auto'")


def kv_layout(config: ModelConfig, engine_config: EngineConfig) -> KVGroupLayout:
    """How layers share block tables and cache slots (`core.kv_groups`): one group per kind of
    attention for hybrid models under the paged policy, else one table for all layers."""
    hybrid = engine_config.kv_policy == "paged" and not engine_config.disable_hybrid_kv_cache_manager
    return plan_kv_groups(config.windows, hybrid=hybrid)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype,
                       layout: KVGroupLayout | None = None, token_scales: bool = False) -> int:
    """Bytes of one block id: every layer's K and V, or one group's layers (hybrid).
    ``dtype``: the cache's storage dtype (1 byte for int8 / FP8 caches); ``token_scales``:
    the cache also has factor slots (`pallas_kernels.kv_quant`, granularity "per_token")."""
    slots = config.num_layers if layout is None else layout.num_slots
    if token_scales:
        slots += factor_slots(slots, config.head_dim)
    return 2 * slots * config.num_kv_heads * block_size * config.head_dim * jnp.dtype(
        dtype).itemsize


def resolve_token_scales(engine_config: EngineConfig, kv_dtype, platform: str) -> bool:
    """Whether the cache keeps per-token factors (`EngineConfig.kv_scale_granularity`):
    "per_token" asks for them (an int8 cache read by the CPU or XLA attention, else an error
    naming the setting); "auto" takes them where they run: an int8 cache on a CPU platform
    with the native or XLA attention."""
    g = engine_config.kv_scale_granularity
    if g not in ("auto", "per_token"):
        return False
    backend = engine_config.attention_backend
    runs = (jnp.dtype(kv_dtype) == jnp.int8 and platform == "cpu"
            and backend in (None, "cpu", "xla"))
    if g == "auto" or runs:
        return runs
    if jnp.dtype(kv_dtype) != jnp.int8:
        raise ValueError(PER_TOKEN_DTYPE + f"; got {engine_config.kv_cache_dtype!r}")
    raise ValueError(PER_TOKEN_BACKENDS)


class ModelRunner:
    def __init__(self, config: ModelConfig, params: dict, engine_config: EngineConfig, dtype,
                 max_model_len: int, shard_vocab: bool = True):
        self._setup(config, engine_config, dtype, max_model_len, shard_vocab)
        if self.kv_scales is not None:
            self.kv_scales = self._place_scales(self.kv_scales)
        if self.mesh is not None:
            params = shard_params(params, config, self.mesh, shard_vocab,
                                  expert_parallel=self.expert_parallel)
        # Committed placement: `update_params` keeps shardings, so the step sees arguments of
        # identical type before and after a weight swap (no retrace, no recompile).
        if self.mesh is None:
            params = jax.device_put(params, jax.local_devices()[0])
        params = self._on_huge_pages(
            self._panels(unstack_layers(params, self.tp) if not self.scan_layers else params))
        # Fixed for the runner's life (the step's form depends on it); the screen follows
        # each weight swap (`params`' setter).
        self.head_outside = self._head_panels(params) is not None
        self.params = params
        del params
        if jax.local_devices()[0].platform == "cpu":
            # Device buffers are heap memory: keep what steps free for the next step, but only
            # from here on, so the weights' transient copies above (placed, unstacked, cut into
            # panels: up to four times the weights at the peak) went back to the system.
            keep_freed_memory()
        self.num_gpu_blocks = engine_config.num_gpu_blocks or self._profile_num_blocks()
        self.num_cpu_blocks = int(engine_config.swap_space_gb * (1 << 30)
                                  // kv_bytes_per_block(config, self.block_size, self.kv_dtype,
                                                        self.kv_layout, self.token_scales))
        self.num_cpu_blocks = min(self.num_cpu_blocks, self.num_gpu_blocks)
        self.k_cache = self._zeros_cache(self.num_gpu_blocks)
        self.v_cache = self._zeros_cache(self.num_gpu_blocks)
        self._host_k: np.ndarray | None = None
        self._host_v: np.ndarray | None = None
        self.compiled_shapes: set[tuple] = set()

    def _setup(self, config: ModelConfig, engine_config: EngineConfig, dtype, max_model_len: int,
               shard_vocab: bool, devices=None) -> None:
        """Model, mesh and sizes: everything but device state (params and caches)."""
        # Tensor parallelism (docs/tensor-parallel.md): params and KV heads split over a
        # ("tp",) mesh; `self.config` is the config the sharded model runs with (KV heads
        # counted after replication), `model_config` the checkpoint's.
        self.tp = engine_config.tensor_parallel_size
        self.model_config = config
        self.mesh = None
        self.device_tables: DeviceTables | None = None  # `enable_device_tables`
        self.device_histories: DeviceHistories | None = None  # `enable_device_histories`
        self.shard_vocab = shard_vocab  # embeddings/lm_head split on vocab (else replicated)
        self.kv_layout = kv_layout(config, engine_config)
        layout = self.kv_layout if self.kv_layout.hybrid else None
        # The cache's storage dtype: the model's, or int8 / FP8 with static scales per
        # (layer, KV head, channel) (`pallas_kernels.kv_quant`), ones until
        # `calibrate_kv_scales`; int8 may add per-token factors in extra cache slots.
        self.kv_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, dtype)
        platform = (devices[0] if devices else jax.devices()[0]).platform
        self.token_scales = resolve_token_scales(engine_config, self.kv_dtype, platform)
        self.cache_slots = self.kv_layout.num_slots + (
            factor_slots(self.kv_layout.num_slots, config.head_dim) if self.token_scales else 0)
        attn = PagedAttention(engine_config.attention_backend, layout, self.token_scales)
        # Expert parallelism: only for MoE models split over more than one device.
        self.expert_parallel = bool(engine_config.enable_expert_parallel and self.tp > 1
                                    and config.num_experts)
        moe_fn = None
        if self.tp > 1:
            validate_tp(config, self.tp, None if devices is None else len(devices),
                        expert_parallel=self.expert_parallel)
            if multihost.is_multiprocess() and engine_config.preemption_mode == "swap":
                raise ValueError("preemption_mode: 'swap' is not supported across processes; "
                                 "use 'recompute'")
            multihost.align_traced_programs()  # before anything here traces a collective
            self.mesh = make_mesh(self.tp, devices)
            config = sharded_config(config, self.tp)
            attn = ShardedPagedAttention(self.mesh, engine_config.attention_backend, layout,
                                         self.token_scales)
            if self.expert_parallel:
                moe_fn = ExpertParallelMoE(self.mesh)
        self.config = config
        self.engine_config = engine_config
        self.dtype = dtype
        check_kv_dtype_on(self.kv_dtype, devices[0] if devices else jax.devices()[0])
        self.kv_scales = None  # placed on the device by __init__
        if is_quantized(self.kv_dtype):
            self.kv_scales = np.ones((config.num_layers, 2, config.num_kv_heads,
                                      config.head_dim), np.float32)
        self.block_size = engine_config.block_size
        self.max_blocks_per_seq = math.ceil(max_model_len / self.block_size)
        self.shape_plan = ShapePlan(
            engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
            self.max_blocks_per_seq,
            fixed_width=cost_follows_length(engine_config.attention_backend),
            block_size=self.block_size,
            min_tokens=min_step_tokens(engine_config),
            spec_tokens=(engine_config.speculative_config.num_speculative_tokens
                         if engine_config.speculative_config is not None else 0))
        self.scan_layers = resolve_layer_loop(engine_config.layer_loop, self.tp, devices) == "scan"
        # Async scheduling: every step merges its token ids (`_make_serve_step`), taking the
        # ids of pending tokens from the previous step's sampler output on the device.
        # With speculative decoding a drafted step's results are awaited before the next
        # step is scheduled (`LLMEngine._launch`); the others overlap as usual.
        self.feed_tokens = resolve_async_scheduling(engine_config.async_scheduling, self.tp,
                                                    devices)
        self.model = DecoderLM(config, attn, dtype, scan_layers=self.scan_layers, moe_fn=moe_fn,
                               packed_matmul=native_packed_matmul(self.tp, devices),
                               fused_shards=self.tp,
                               norm_fn=fused_norm_fn(engine_config.attention_backend, self.tp,
                                                     platform))
        # Plain greedy batches sample with the native one-pass kernel on one CPU device
        # (`pagedjax.sampler.sample_greedy`'s ``native``); XLA's three passes elsewhere, or
        # with ``PAGEDJAX_NATIVE_GREEDY=0`` (for comparisons).
        self.native_greedy = (self.tp == 1 and platform == "cpu"
                              and os.environ.get("PAGEDJAX_NATIVE_GREEDY", "1")
                              not in ("0", "false") and _native_cpu())
        # A step's results to the host (`LLMEngine._finish`, once a step). On one CPU device
        # each leaf's buffer is read in place (`np.asarray`): `jax.device_get` first starts a
        # host copy per leaf, ~70-140 us more than that for a sampler output's five arrays
        # (measured in one process). Elsewhere `device_get`, whose copies run side by side.
        self.fetch = read_in_place if (self.tp == 1 and platform == "cpu") else jax.device_get
        # Sampled batches cut and draw each row natively there too (`pagedjax.sampler.sample`'s
        # ``native``: a row costs itself, not the batch's widest nucleus);
        # ``PAGEDJAX_NATIVE_SAMPLER=0`` keeps XLA's batch-wide branches.
        self.native_sampler = (self.tp == 1 and platform == "cpu"
                               and os.environ.get("PAGEDJAX_NATIVE_SAMPLER", "1")
                               not in ("0", "false") and _native_cpu())
        # GPUs take the sampler's candidates and top logprobs from a two-stage top-k
        # (`pagedjax.chunked_top_k`): XLA's GPU top-k sorts the rows for k > 16.
        # ``PAGEDJAX_CHUNKED_TOPK=0`` keeps one `lax.top_k` (for comparisons), ``=1`` takes
        # the two stages on any platform (for tests on CPU).
        chunked = os.environ.get("PAGEDJAX_CHUNKED_TOPK", "auto").lower()
        self.chunked_top_k = (chunked in ("1", "true") or (
            chunked not in ("0", "false") and platform == "gpu"))
        # Set from the params in `__init__`: the step returns hidden states and the runner
        # applies the LM head (`execute`), so greedy rows can take the screened head instead
        # (`execute_hidden`, `head_screen`).
        self.head_outside = False
        self.head_screen: dict | None = None

    @classmethod
    def compile_only(cls, config: ModelConfig, engine_config: EngineConfig, dtype,
                     max_model_len: int, devices, shard_vocab: bool = True) -> ModelRunner:
        """A runner that holds no device state, over compile-only ``devices``: its `_step`
        can be lowered with `abstract_state` for deviceless AOT compilation
        (`pagedjax.aot.step`), so the compile tier builds the serving step's model and
        kernels (serving wraps `_step`'s body in `_make_serve_step`'s argument unpacking and
        pending-token merge, a few slices and one gather, and with device block tables a
        scatter of the changed entries and a gather of the step's rows)."""
        self = cls.__new__(cls)
        self._setup(config, engine_config, dtype, max_model_len, shard_vocab, devices)
        self.devices = tuple(devices)
        return self

    def abstract_state(self, num_blocks: int) -> tuple[dict, jax.ShapeDtypeStruct,
                                                         jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs of (params, k_cache, v_cache) as this runner would place them."""
        from models.weights import abstract_params

        params = abstract_params(self.model_config, self.dtype)
        c = self.config
        shape = (self.cache_slots, c.num_kv_heads, num_blocks, self.block_size, c.head_dim)
        dtype = self.kv_dtype
        if self.mesh is None:
            sh = jax.sharding.SingleDeviceSharding(self.devices[0])
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                  params)
            cache = jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
        else:
            params = abstract_sharded_params(params, self.model_config, self.mesh,
                                             self.shard_vocab, self.expert_parallel)
            cache = jax.ShapeDtypeStruct(shape, dtype, sharding=cache_sharding(self.mesh))
        if not self.scan_layers:
            params = unstack_layers(params, self.tp)
        return params, cache, cache

    def _zeros_cache(self, num_blocks: int) -> jax.Array:
        """A zero KV cache, split on the KV-head axis under tensor parallelism."""
        c = self.config
        shape = (self.cache_slots, c.num_kv_heads, num_blocks, self.block_size, c.head_dim)
        if self.mesh is None:
            from pallas_kernels import cpu_native

            device = jax.local_devices()[0]
            if device.platform == "cpu" and huge_pages.enabled() and cpu_native.available():
                # 2 MiB pages for the blocks the attention reads (`csrc/zeros_huge_pages_cpu.cc`)
                return cpu_native.zeros_on_huge_pages(shape, self.kv_dtype, device)
            return jax.device_put(jnp.zeros(shape, self.kv_dtype), device)  # committed
        return jnp.zeros(shape, self.kv_dtype, device=cache_sharding(self.mesh))

    def _place_scales(self, scales: np.ndarray) -> jax.Array:
        """KV scales `[layers, 2, Hkv, D]` where the step reads them: split on the head axis
        like the cache under tensor parallelism."""
        scales = np.asarray(scales, np.float32)
        if self.mesh is None:
            return jax.device_put(scales, jax.local_devices()[0])
        return jax.device_put(scales, NamedSharding(self.mesh, P(None, None, AXIS, None)))

    def calibrate_kv_scales(self, token_ids: list[int]) -> np.ndarray:
        """Set the quantized cache's static scales from one full-precision pass over
        ``token_ids`` (`worker.kv_calibration`); returns them ``[layers, 2, Hkv, D]``. Blocks
        written with other scales read wrong afterwards: call before serving (the engine
        does, and again after a weight swap, which recomputes every sequence)."""
        if self.kv_scales is None:
            raise ValueError("calibrate_kv_scales: the KV cache is not quantized")
        from pagedjax.worker.kv_calibration import CalibrationAttention, calibrate_amax

        model = DecoderLM(self.config, CalibrationAttention(), self.dtype,
                          scan_layers=self.scan_layers, moe_fn=self.model.moe_fn,
                          packed_matmul=self.model.packed_matmul, fused_shards=self.tp)
        c = self.config
        amax = calibrate_amax(model, self.params, c.num_layers, c.num_kv_heads, c.head_dim,
                              token_ids)
        gran = self.engine_config.kv_scale_granularity
        # Per-token factors sit on channel scales (their headroom is moot: factors fit each
        # token); "auto" without factors is per channel.
        scales = scales_from_amax(amax, self.kv_dtype,
                                  "per_channel" if gran in ("auto", "per_token") else gran)
        self.kv_scales = self._place_scales(scales)
        return scales

    @property
    def num_kv_groups(self) -> int:
        return self.kv_layout.num_groups

    def cache_lost(self) -> bool:
        """True when a failed call took the donated KV cache with it (its buffers deleted):
        every later step would fail on them."""
        return (self.k_cache.is_deleted() or self.v_cache.is_deleted()
                or (self.device_tables is not None and self.device_tables.array.is_deleted())
                or (self.device_histories is not None
                    and self.device_histories.array.is_deleted()))

    def reset_cache(self) -> None:
        """A fresh zero KV cache of the same size (after `cache_lost`), and fresh device block
        tables and penalty histories (the engine then has every row sent whole again:
        `InputBatch.invalidate`, `HistorySlots.invalidate`)."""
        self.k_cache = self._zeros_cache(self.num_gpu_blocks)
        self.v_cache = self._zeros_cache(self.num_gpu_blocks)
        if self.device_tables is not None:
            self.device_tables.reset()
        if self.device_histories is not None:
            self.device_histories.reset()

    @property
    def params(self) -> dict:
        return self._params

    @params.setter
    def params(self, params: dict) -> None:
        """The weights; with the LM head outside the step, its bfloat16 screen is rebuilt
        from them (None when the head is not finite: then greedy rows take the full head).
        Also kept as one flat tuple of leaves for `_serve_step` (see `_make_serve_step`)."""
        self._params = params
        leaves, treedef = jax.tree.flatten(params)
        self._flat_params = tuple(leaves)
        old = getattr(self, "_params_treedef", None)
        if old is None or old != treedef:
            self._params_treedef = treedef
            self._serve_step = self._make_serve_step(treedef)
        self.head_screen = None
        if self.head_outside:
            from pallas_kernels import cpu_native

            screen = cpu_native.lm_head_screen(np.asarray(self.head_panels),
                                               self.model_config.vocab_size)
            if screen is None:
                logger.warning("the LM head is not finite: greedy rows take the full head")
            else:
                self.head_screen = self._on_huge_pages(
                    jax.device_put(screen, jax.local_devices()[0]))

    def _head_panels(self, params: dict) -> jax.Array | None:
        """The LM head's float32 panels when the runner applies the head itself: greedy
        sampling through the native kernels (one CPU device), unrolled float32 layers with
        the head in panels (`models.qlinear.dense_panelize`), no final soft-capping (which
        may turn distinct logits into ties), and a screen that pays (`screened_head_setting`).
        Else None: the step computes the logits."""
        c = self.model_config
        if (not self.native_greedy or self.scan_layers or c.final_softcap
                or not screened_head_setting()):
            return None
        return self._panels_of_head(params)

    def _panels_of_head(self, params: dict) -> jax.Array | None:
        c = self.model_config
        node = params.get("embed") if c.tie_word_embeddings else params.get("lm_head")
        if (isinstance(node, dict) and set(node) == {"panels"}
                and node["panels"].dtype == jnp.float32):
            return node["panels"]
        return None

    @property
    def head_panels(self) -> jax.Array:
        """The LM head's float32 panels (`head_outside` runners)."""
        return self._panels_of_head(self._params)

    def place_params(self, params: dict) -> dict:
        """Put a checkpoint-layout params pytree where this runner keeps its params (for
        `update_params`: under TP this shards it and replicates KV columns as needed)."""
        if self.mesh is None:
            placed = jax.device_put(params, jax.local_devices()[0])
        else:
            placed = shard_params(params, self.model_config, self.mesh, self.shard_vocab,
                                  expert_parallel=self.expert_parallel)
        return self._on_huge_pages(self._panels(placed if self.scan_layers else
                                                unstack_layers(placed, self.tp)))

    def _on_huge_pages(self, params: dict) -> dict:
        """One CPU device: the weights on transparent huge pages (`worker.huge_pages` says why)."""
        if self.mesh is not None or jax.local_devices()[0].platform != "cpu":
            return params
        return place_on_huge_pages(params, jax.local_devices()[0])

    def _panels(self, params: dict) -> dict:
        """Packed weights in the 64-column panels the native CPU kernel streams
        (`models.qlinear.panelize`) when the model multiplies with it; with the unrolled
        layers of a float32 model, its dense kernels and LM head too
        (`models.qlinear.dense_panelize`: a step of a few rows, a decode or a speculative
        verification, then reads each weight once instead of XLA's per-call GEMM packing;
        ``PAGEDJAX_DENSE_PANELS=0`` keeps XLA's dots, for comparisons)."""
        from pallas_kernels import cpu_native

        if self.model.packed_matmul is not cpu_native.packed_matmul_cpu:
            return params
        from models.qlinear import dense_panelize, panelize

        params = panelize(params)
        if (not self.scan_layers and self.model.dtype == jnp.float32
                and os.environ.get("PAGEDJAX_DENSE_PANELS", "1") not in ("0", "false")):
            params = dense_panelize(params)
        return params

    # ---- sizing ------------------------------------------------------------
    def _profile_num_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of device memory after weights and
        activations (measured with a max-size dummy step), like vLLM's profiling run."""
        # Per device: under TP each device holds 1/N of every block's heads.
        per_block = kv_bytes_per_block(self.config, self.block_size, self.kv_dtype,
                                       self.kv_layout, self.token_scales) // self.tp
        dev = jax.local_devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return max(16, int(self.engine_config.cpu_kv_cache_gb * (1 << 30) // per_block))
        # Dummy step at the largest token bucket with a tiny cache to measure the peak.
        self.k_cache = self._zeros_cache(16)
        self.v_cache = self._zeros_cache(16)
        n = self.engine_config.max_num_batched_tokens
        from pagedjax.core.scheduler import ScheduledSeq
        from pagedjax.worker.step_inputs import build_step_inputs

        fake = [ScheduledSeq(0, "profile", [0] * n, 0, [0] * math.ceil(n / self.block_size), True)]
        inputs = build_step_inputs(fake, self.block_size, self.max_blocks_per_seq,
                                   num_groups=self.num_kv_groups)
        inputs.meta.slot_mapping[:] = -1  # write nothing
        jax.block_until_ready(self._execute_local(inputs))  # every process runs it
        stats = dev.memory_stats()
        budget = stats["bytes_limit"] * self.engine_config.gpu_memory_utilization
        free = budget - stats.get("peak_bytes_in_use", stats["bytes_in_use"])
        blocks = int(free // per_block)
        if multihost.is_multiprocess():  # one block manager: every host must fit its shard
            blocks = multihost.min_over_processes(blocks)
        if blocks < 1:
            raise RuntimeError(f"no device memory left for the KV cache (free {free / 2**30:.2f} GiB)")
        logger.info("profiled %d KV blocks (%.2f GiB)", blocks, blocks * per_block / 2**30)
        return blocks

    # ---- step --------------------------------------------------------------
    def _step_body(self, params, k_cache, v_cache, input_ids, positions, meta: PagedMeta,
                   logits_indices):
        logits, (k_cache, v_cache) = self.model.apply(
            {"params": params}, input_ids, positions, (k_cache, v_cache), meta,
            logits_indices=logits_indices, return_hidden=self.head_outside)
        if self.mesh is not None:  # sampling sees full logits; caches stay split by head
            if vocab_sharded(self.model_config, self.tp, self.shard_vocab):
                # Pin the vocab-split result first, so XLA all-gathers the [R, V] logits
                # rather than the [H, V] LM head (which it otherwise picks to meet P()).
                logits = jax.lax.with_sharding_constraint(
                    logits, NamedSharding(self.mesh, P(None, AXIS)))
            logits = jax.lax.with_sharding_constraint(logits, replicated(self.mesh))
            k_cache = jax.lax.with_sharding_constraint(k_cache, cache_sharding(self.mesh))
            v_cache = jax.lax.with_sharding_constraint(v_cache, cache_sharding(self.mesh))
        return logits, k_cache, v_cache

    # The step over a params pytree: what tools lower and compile (`pagedjax.aot`).
    _step = partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))(_step_body)

    def _make_serve_step(self, treedef):
        """The step as serving calls it, with as few arguments as it can have: the weights as
        one flat tuple of leaves (``treedef`` fixed), and all of the step's host-built int32
        arrays (token ids, positions, the `PagedMeta` arrays, logits rows) packed into one
        buffer (`_step_args`; ``layout`` names each one's shape, so it is static), one
        transfer instead of nine. Async scheduling's pending token ids are merged in the same
        call: the ids of `input_ids`, except where `prev_rows[t] >= 0`, which takes the
        previous step's sampled token of that row (the host never saw it).

        Why: on the 2-core CPU host every millisecond of the dispatching thread is on a
        batched step's critical path (`bench/host_critical_path.py`). Flattening the nested
        params dict (its keys sorted at every call), a transfer per host array and a second
        dispatch for the merge took ~0.5 ms of a 64-row step's ~1 ms dispatch
        (`bench/host_breakdown.py`). Rebuilt only when the params' structure changes, so a
        weight swap of the same structure reuses the compiled steps."""
        def serve_step(leaves, k_cache, v_cache, ints, prev_tokens, kv_scales, dev_tables,
                       layout, decode_only, table_width):
            parts, at = [], 0
            for shape in layout:
                n = math.prod(shape) if shape is not None else 0
                parts.append(None if shape is None else ints[at : at + n].reshape(shape))
                at += n
            ids, prev_rows, positions, slots, kv_lens, tables, cu_q_lens, num_seqs, rows = (
                parts[:9])
            if prev_rows is not None:
                ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], ids)
            if table_width is not None:  # `tables` holds row numbers into `dev_tables`
                dev_tables = apply_writes(dev_tables, parts[9], parts[10])
                tables = gather_rows(dev_tables, tables, table_width)
            meta = PagedMeta(slots, kv_lens, tables, cu_q_lens, num_seqs[0], decode_only,
                             kv_scales)
            out = self._step_body(jax.tree.unflatten(treedef, leaves), k_cache, v_cache,
                                  ids, positions, meta, rows)
            return out if table_width is None else (*out, dev_tables)

        return jax.jit(serve_step, donate_argnums=(1, 2, 6), static_argnums=(7, 8, 9))

    def enable_device_tables(self, rows: int) -> None:
        """Keep the engine's `InputBatch` rows (``rows`` of them) on the device: its steps
        then send row numbers and the entries that changed instead of their block tables
        (`worker.device_tables`). One device only; steps built without the batch (warm-up,
        tools, a draft model's) keep sending their tables."""
        if self.mesh is not None:
            raise ValueError("device block tables need a single-device runner")
        self.device_tables = DeviceTables(rows, self.num_kv_groups, self.max_blocks_per_seq,
                                          jax.local_devices()[0])

    def enable_device_histories(self, slots: int, width: int) -> None:
        """Keep penalised sequences' prompt and output ids on the device, ``slots`` rows of
        ``width`` (`worker.device_histories`): sampler batches then send slot numbers and the
        ids that are new instead of their packed histories. One device only."""
        if self.mesh is not None:
            raise ValueError("device penalty histories need a single-device runner")
        self.device_histories = DeviceHistories(slots, width, self.shape_plan.spec_tokens,
                                                jax.local_devices()[0])

    def gather_histories(self, *args, **kwargs) -> tuple[jax.Array, jax.Array]:
        """`DeviceHistories.gather`; a failed call resets the copy (the caller then forgets
        its slots: `HistorySlots.invalidate`)."""
        try:
            return self.device_histories.gather(*args, **kwargs)
        except Exception:
            self.device_histories.reset()
            raise

    def warmup(self, prompt_logprobs: bool = True,
               pool: concurrent.futures.Executor | None = None) -> list[tuple]:
        """Compile the step at every shape of `shape_plan` (with or without the prompt-logprob
        row variants); returns the shapes. After this, serving never compiles a step.

        Each dummy step writes nowhere (slot -1) and reads nothing (context lengths 0), so the
        KV cache is untouched. With a `pool`, the shapes are first compiled side by side
        (ahead of time: lowering takes the caches without consuming them, and the jitted step
        then finds each executable compiled), then run one at a time, since each run donates
        the caches. A multi-process runner compiles as it runs: its followers compile when
        the leader's steps reach them.
        """
        from pagedjax.core.scheduler import ScheduledSeq
        from pagedjax.worker.step_inputs import build_step_inputs

        plan = self.shape_plan
        shapes = plan.step_shapes(prompt_logprobs)
        dummies: list[StepInputs] = []
        for t, s, m, r, decode in shapes:
            rows = spec_lens = None
            if decode:
                fake = [ScheduledSeq(i, "warmup", [0], 0, [0] * m, True) for i in range(s)]
                extra = None
            else:  # t tokens over as few sequences as hold them (m blocks each)
                cap = m * self.block_size
                n_tok = min(t, s * cap)  # > t / 2: still bucket t (see ShapePlan.step_shapes)
                sizes = [cap] * (n_tok // cap) + ([n_tok % cap] if n_tok % cap else [])
                fake = [ScheduledSeq(i, "warmup", [0] * n, 0, [0] * m, True)
                        for i, n in enumerate(sizes)]
                extra = list(range(r - s)) or None
                if plan.spec_tokens and r == t > s:  # speculation: a sampled row per token
                    rows, spec_lens, extra = sizes, [n - 1 for n in sizes], None
            inputs = build_step_inputs(fake, self.block_size, self.max_blocks_per_seq,
                                       rows_per_seq=rows, extra_rows=extra, plan=plan,
                                       num_groups=self.num_kv_groups, spec_lens=spec_lens)
            assert inputs.shape_key == (t, s, m, r, decode), (inputs.shape_key, (t, s, m, r))
            inputs.meta.slot_mapping[:] = -1
            inputs.meta.kv_lens[:] = 0
            if self.device_tables is not None:  # serving's steps read tables on the device
                inputs.meta = dataclasses.replace(inputs.meta, block_tables=None)
                inputs.table_rows = np.zeros(s, np.int32)  # reads nothing: lengths 0
            dummies.append(inputs)
        if pool is not None and not multihost.is_multiprocess():
            def compile_ahead(inp: StepInputs) -> None:
                self._serve_step.lower(*self._step_args(inp)).compile()

            for _ in pool.map(compile_ahead, dummies):
                pass
        for inputs in dummies:
            jax.block_until_ready(self.execute(inputs))
        if self.device_tables is not None:
            self.device_tables.warm()
        for n in plan.copy_buckets(self.num_gpu_blocks):
            self.copy_blocks([(0, 0)] * n)  # block 0 onto itself: a no-op (broadcast when multi-process)
        if self.num_cpu_blocks and self.mesh is None:
            # Swap gathers/scatters, one per power-of-two bucket of blocks (pallas_kernels.swap):
            # the gather reads block 0, the scatter targets a block past the end (dropped).
            n = 8
            while True:
                swap_out(self.k_cache, self.v_cache, np.zeros(n, np.int32))
                host = np.zeros(self.k_cache.shape[:2] + (n,) + self.k_cache.shape[3:],
                                self.k_cache.dtype)
                self.k_cache, self.v_cache = swap_in(self.k_cache, self.v_cache, host, host,
                                                     np.full(n, self.num_gpu_blocks, np.int32))
                if n >= self.num_cpu_blocks:
                    break
                n *= 2
        return shapes

    def execute(self, inputs: StepInputs) -> jax.Array:
        """Run the model on one step; returns device logits [R, vocab] (no host sync).

        In a multi-process run the leader (process 0) first broadcasts the step's arrays so
        every process enters the same collective step (`pagedjax.parallel.multihost`)."""
        if self.mesh is not None and multihost.is_leader_of_many():
            multihost.send_step(inputs)
        out = self._execute_local(inputs)
        return self._head(self.head_panels, out) if self.head_outside else out

    def execute_hidden(self, inputs: StepInputs) -> jax.Array:
        """Run the model on one step without the LM head (`head_outside` only): the sampled
        rows' final hidden states [R, hidden], for `pagedjax.sampler.sample_greedy_hidden`."""
        if not self.head_outside:
            raise RuntimeError("execute_hidden: this runner's step computes the logits")
        return self._execute_local(inputs)

    @partial(jax.jit, static_argnums=0)
    def _head(self, panels: jax.Array, hidden: jax.Array) -> jax.Array:
        """The LM head the step leaves out (`head_outside`): the same panel matmul the model
        runs (`DecoderLM`), so the logits are the same bits."""
        from pallas_kernels.cpu_native import dense_matmul_cpu

        return dense_matmul_cpu(hidden, panels, self.model_config.vocab_size).astype(jnp.float32)

    def _step_args(self, inputs: StepInputs) -> tuple:
        """`_serve_step`'s arguments for one step (the caches as they are now). Steps from
        the engine's batch with device tables take its queued row writes here, at dispatch."""
        ids, rows, prev = inputs.input_ids, None, None
        if self.mesh is None:  # always merged, so sync and async steps share one compile
            prev = inputs.prev_tokens if inputs.prev_tokens is not None else self._no_tokens()
            rows = inputs.prev_rows if inputs.prev_rows is not None else np.full(
                ids.shape, -1, np.int32)
        m = inputs.meta
        tables, extra, width, dev = m.block_tables, (), None, None
        if inputs.table_rows is not None:
            if self.device_tables is None:
                raise RuntimeError("a step with device block-table rows, but this runner keeps "
                                   "none (`enable_device_tables`)")
            t_pad, s_pad, width = inputs.shape_key[:3]
            idx, val = (inputs.table_source.take_deltas() if inputs.table_source is not None
                        else (np.zeros(0, np.int32),) * 2)
            tables, *extra = self.device_tables.step_parts(
                inputs.table_rows, idx, val, table_capacity(t_pad, s_pad, self.block_size))
            dev = self.device_tables.array
        parts = (ids, rows, inputs.positions, m.slot_mapping, m.kv_lens, tables,
                 m.cu_q_lens, np.reshape(m.num_seqs, 1), inputs.logits_indices, *extra)
        layout = tuple(None if p is None else p.shape for p in parts)
        ints = np.concatenate([p.ravel() for p in parts if p is not None], dtype=np.int32)
        return (self._flat_params, self.k_cache, self.v_cache, ints, prev, self.kv_scales,
                dev, layout, m.decode_only, width)

    def _execute_local(self, inputs: StepInputs) -> jax.Array:
        if inputs.shape_key not in self.compiled_shapes:
            self.compiled_shapes.add(inputs.shape_key)
        if inputs.table_rows is None:
            logits, self.k_cache, self.v_cache = self._serve_step(*self._step_args(inputs))
        else:
            try:
                logits, self.k_cache, self.v_cache, self.device_tables.array = (
                    self._serve_step(*self._step_args(inputs)))
            except BaseException:
                # The writes taken for this step may not have reached the device copy: start
                # it from zeros, and the batch sends every row whole again.
                self.device_tables.reset()
                if inputs.table_source is not None:
                    inputs.table_source.invalidate()
                raise
        if self.mesh is not None:
            # Replicated: this process's first shard is the full [R, vocab] array, so sampling
            # runs on one local device (and only on the leader in multi-process runs).
            logits = logits.addressable_data(0)
        return logits

    def step_meta(self, meta: PagedMeta) -> PagedMeta:
        """The step's metadata as `_step` takes it: the host-built part plus the quantized
        cache's scales, which stay on the device (not part of a step's host inputs)."""
        if self.kv_scales is None:
            return meta
        return dataclasses.replace(meta, kv_scales=self.kv_scales)

    # ---- async scheduling: token ids that are still on the device ------------
    @partial(jax.jit, static_argnums=0)
    def _pad_tokens(self, tokens):
        cap = self.shape_plan.sample_cap
        return jnp.zeros(cap, jnp.int32).at[: tokens.shape[0]].set(tokens.astype(jnp.int32))

    def sampled_tokens(self, tokens: jax.Array) -> jax.Array:
        """A step's sampled token ids, padded on the device to the largest sampler batch:
        the next step's merge (`_make_serve_step`) then has one shape per token bucket."""
        return self._pad_tokens(tokens)

    def _no_tokens(self) -> jax.Array:
        if getattr(self, "_zero_tokens", None) is None:
            self._zero_tokens = jax.device_put(np.zeros(self.shape_plan.sample_cap, np.int32),
                                               jax.local_devices()[0])
        return self._zero_tokens

    @partial(jax.jit, static_argnums=0)
    def _merge_history(self, history, cols, prev_rows, prev_tokens):
        b = jnp.arange(history.shape[0])
        col = jnp.where(cols >= 0, cols, history.shape[1])  # -1: nothing (out of bounds, dropped)
        return history.at[b, col].set(prev_tokens[jnp.maximum(prev_rows, 0)], mode="drop")

    def merge_pending_history(self, history: np.ndarray, cols: np.ndarray, prev_rows: np.ndarray,
                              prev_tokens: jax.Array) -> jax.Array:
        """Penalty histories `[rows, width]` with each pending token written in on the device:
        row r gets the previous step's sampled token of row `prev_rows[r]` at column `cols[r]`
        (-1: none). The host never sees that token before the sampler needs it, so penalised
        requests need no host sync under async scheduling."""
        return self._merge_history(history, cols, prev_rows, prev_tokens)

    def warmup_token_feed(self, history_width: int = 0) -> None:
        """Compile `_pad_tokens`, and `_merge_history` at `history_width`, for every sampler
        batch size (the sequence buckets); and the device histories' calls."""
        if self.device_histories is not None:
            self.device_histories.warm(self.shape_plan.sample_buckets)
        if not self.feed_tokens:
            return
        dev = jax.local_devices()[0]
        for b in self.shape_plan.sample_buckets:
            tokens = self.sampled_tokens(jax.device_put(np.zeros(b, np.int32), dev))
            jax.block_until_ready(tokens)
            if history_width:
                none = np.full(b, -1, np.int32)
                history = np.zeros((b, history_width), np.int32)
                if self.device_histories is not None:  # gathered there: a committed array
                    history = jax.device_put(history, dev)
                jax.block_until_ready(self.merge_pending_history(history, none, none, tokens))

    # ---- block operations --------------------------------------------------
    @staticmethod
    def _pad_pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
        arr = np.full((bucket(len(pairs), 8), 2), -1, np.int32)
        arr[: len(pairs)] = pairs
        return arr

    @partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
    def _copy(self, k_cache, v_cache, mapping):
        backend = self.engine_config.attention_backend
        if self.mesh is not None:
            return sharded_copy_blocks(self.mesh, k_cache, v_cache, mapping, backend)
        return copy_blocks(k_cache, v_cache, mapping, backend=backend)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            mapping = self._pad_pairs(pairs)
            if self.mesh is not None and multihost.is_leader_of_many():
                multihost.send_copy(mapping)
            self._copy_local(mapping)

    def _copy_local(self, mapping: np.ndarray) -> None:
        self.k_cache, self.v_cache = self._copy(self.k_cache, self.v_cache, mapping)

    def _host_pool(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host_k is None:
            shape = (self.cache_slots, self.config.num_kv_heads, max(self.num_cpu_blocks, 1),
                     self.block_size, self.config.head_dim)
            self._host_k = np.zeros(shape, self.k_cache.dtype)
            self._host_v = np.zeros(shape, self.v_cache.dtype)
        return self._host_k, self._host_v

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GPU blocks to the host pool: pairs of (gpu_block, cpu_block)."""
        if not pairs:
            return
        host_k, host_v = self._host_pool()
        gpu = np.asarray([g for g, _ in pairs], np.int32)
        cpu = np.asarray([c for _, c in pairs], np.int32)
        k_blocks, v_blocks = swap_out(self.k_cache, self.v_cache, gpu)
        host_k[:, :, cpu] = k_blocks
        host_v[:, :, cpu] = v_blocks

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back into the device cache: pairs of (cpu_block, gpu_block)."""
        if not pairs:
            return
        host_k, host_v = self._host_pool()
        cpu = np.asarray([c for c, _ in pairs], np.int32)
        gpu = np.asarray([g for _, g in pairs], np.int32)
        self.k_cache, self.v_cache = swap_in(self.k_cache, self.v_cache, host_k[:, :, cpu],
                                             host_v[:, :, cpu], gpu)
        if self.mesh is not None:  # keep the head split whatever the scatter's output layout
            sh = cache_sharding(self.mesh)
            self.k_cache, self.v_cache = jax.device_put((self.k_cache, self.v_cache), sh)
