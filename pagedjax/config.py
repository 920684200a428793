"""Engine configuration (validated before any weights are loaded)."""

from __future__ import annotations

import dataclasses

from pagedjax.spec.config import SpeculativeConfig

# `pallas_kernels.kv_quant.KV_CACHE_DTYPES` and "auto" (named here: no jax import in config).
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_SCALE_GRANULARITIES = ("auto", "per_token", "per_channel", "per_head", "per_tensor")


@dataclasses.dataclass
class EngineConfig:
    """Knobs of the paged engine; names follow vLLM's `LLM(...)` arguments."""

    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: size from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    # vLLM's default for `LLM`. It was 64 here: 256 prompts x 64 tokens then ran in four waves,
    # 523.5 tok/s against 649.4 in one on this project's CPU host (one weight read per step
    # for 4x the rows; `bench/results/cpu/offline_throughput_seqs.json`).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: min(model context, 4096)
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    swap_space_gb: float = 0.25
    # Both None: on with kv_policy "paged", as in vLLM V1, where a prompt longer than
    # max_num_batched_tokens runs in chunks instead of being refused and a repeated prefix
    # (a system prompt, a chat's history) is computed once; off for the paper's contiguous
    # and static baselines, which have neither. Resolved to a bool in `__post_init__`.
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    # "fcfs" | "priority" (vLLM's: each request's `priority`, lower first, may preempt
    # running requests of a lower priority) | "srtf" (thesis Alg. 2).
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None  # "pallas" | "xla" | "cpu" | None (auto by platform)
    seed: int = 0
    tensor_parallel_size: int = 1
    # KV memory manager: "paged" (this engine) or a baseline from the paper's evaluation:
    # "contiguous-max" | "contiguous-pow2" | "contiguous-oracle" (Orca-style regions from a
    # buddy allocator) | "static" (FasterTransformer-style request-level batches).
    kv_policy: str = "paged"
    # Compile every decode/prefill shape bucket at start so serving never stalls on a
    # compile. None: on accelerators only (on CPU each of ~12 compiles takes seconds).
    warmup: bool | None = None
    # Decoder layers as one `scan` ("scan": one compiled layer body, fast compiles) or a loop
    # over per-layer weights ("unrolled": no per-step weight copies, see models/decoder.py).
    # None: $PAGEDJAX_LAYER_LOOP, else "unrolled" on a single CPU device, where it makes decode
    # 1.7x faster; "scan" on GPUs and under tensor parallelism until a GPU run has measured
    # the loop there (`worker.model_runner.resolve_layer_loop`).
    layer_loop: str | None = None
    # Asynchronous scheduling (thesis §4.6.1): schedule step N+1 and process step N's outputs
    # while step N runs on the device. None: on with one device, CPU included (measured in
    # bench/offline_throughput.py, engines pagedjax-sync / pagedjax-async), off under tensor
    # parallelism; outputs are identical either way.
    async_scheduling: bool | None = None
    # Block tables kept on the device and updated by deltas (thesis §4.6.2;
    # `worker.device_tables`): a step sends its sequences' row numbers and the table entries
    # that changed, not its [S, max_model_len / block_size] tables. None: on with one device;
    # under tensor parallelism the tables travel with each step as before.
    device_block_tables: bool | None = None
    # Penalised requests' prompt and output ids kept on the device and extended by deltas
    # (`worker.device_histories`), not packed into [rows, max_model_len] arrays each step.
    # None: on with one device; under tensor parallelism they are packed as before.
    device_penalty_histories: bool | None = None
    # CPU has no device-memory budget to measure; this caps the automatic sizing there.
    cpu_kv_cache_gb: float = 0.5
    # Models mixing sliding-window and global layers (Gemma 2/3) get one block table per
    # KV-cache group, so windowed layers free the blocks behind their window
    # (`core.kv_groups`); True keeps one table for all layers (vLLM's flag of the same name).
    disable_hybrid_kv_cache_manager: bool = False
    # Mixture-of-experts under tensor parallelism: whole experts per device instead of a slice
    # of every expert (`parallel.experts`; vLLM's flag). No effect at tensor_parallel_size 1.
    enable_expert_parallel: bool = False
    # Speculative decoding (thesis §4.4.4; `pagedjax.spec`): a `SpeculativeConfig`, a dict of
    # its fields or that dict as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3}.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # KV cache storage (vLLM's `kv_cache_dtype`): "auto" (the model's dtype), "int8",
    # "fp8" / "fp8_e4m3" or "fp8_e5m2": 1 byte per value, so a block costs 1/4 of fp32's or
    # 1/2 of bf16's and `gpu_memory_utilization` buys that many more blocks. Static scales
    # per (layer, KV head, channel), calibrated on one prompt at start
    # (`pallas_kernels.kv_quant` says why per channel; `worker.kv_calibration`).
    kv_cache_dtype: str = "auto"
    # "per_token": the channel scales times a factor per (token, KV head) kept in the cache
    # (4 more bytes per token and head: int8 only, CPU / XLA attention; halves the greedy
    # disagreement, docs/quantization.md); "per_channel" | "per_head" | "per_tensor": static
    # scales only; "auto": per_token where it runs (an int8 cache on CPU), else per_channel.
    kv_scale_granularity: str = "auto"
    # Weight-only quantization (vLLM's `quantization`): None expands checkpoints to the
    # model dtype; "gguf" keeps a GGUF file's quantized tensors packed on the device
    # (`models.packed`: dense projections, embedding and LM head), dequantized inside the step
    # next to each matmul; "int8" quantizes those weights per output channel at load.
    quantization: str | None = None
    # Structured outputs (vLLM's `structured_outputs_config`, a dict or its JSON):
    # {"backend": "auto" | "guidance" | "outlines"} (`pagedjax.structured.backend`); "auto"
    # is llguidance, which serves every kind of constraint.
    structured_outputs_config: dict | str | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{field} {msg}")

        need(self.block_size in (8, 16, 32, 64, 128, 256), "block_size",
             f"must be one of 8, 16, 32, 64, 128, 256; got {self.block_size}")
        need(self.num_gpu_blocks is None or self.num_gpu_blocks > 0, "num_gpu_blocks",
             f"must be positive; got {self.num_gpu_blocks}")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
             f"must be in (0, 1]; got {self.gpu_memory_utilization}")
        need(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1; got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
             f"must be >= 1; got {self.max_num_batched_tokens}")
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode",
             f"must be 'recompute' or 'swap'; got {self.preemption_mode!r}")
        need(self.swap_space_gb >= 0, "swap_space_gb", "must be >= 0")
        need(self.scheduling_policy in ("fcfs", "priority", "srtf"), "scheduling_policy",
             f"must be 'fcfs', 'priority' or 'srtf'; got {self.scheduling_policy!r}")
        need(self.attention_backend in (None, "pallas", "xla", "cpu"), "attention_backend",
             f"must be 'pallas', 'xla', 'cpu' or None; got {self.attention_backend!r}")
        need(self.layer_loop in (None, "scan", "unrolled"), "layer_loop",
             f"must be 'scan', 'unrolled' or None; got {self.layer_loop!r}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        need(self.kv_cache_dtype in KV_CACHE_DTYPE_NAMES, "kv_cache_dtype",
             f"must be one of {KV_CACHE_DTYPE_NAMES}; got {self.kv_cache_dtype!r}")
        need(self.quantization in (None, "gguf", "int8"), "quantization",
             f"must be None, 'gguf' or 'int8'; got {self.quantization!r}")
        need(self.kv_scale_granularity in KV_SCALE_GRANULARITIES, "kv_scale_granularity",
             f"must be one of {KV_SCALE_GRANULARITIES}; got {self.kv_scale_granularity!r}")
        from pagedjax.core.policies import KV_POLICIES

        need(self.kv_policy in KV_POLICIES, "kv_policy",
             f"must be one of {KV_POLICIES}; got {self.kv_policy!r}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.kv_policy == "paged"
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = self.kv_policy == "paged"
        need(self.kv_policy == "paged" or not self.enable_prefix_caching, "enable_prefix_caching",
             "requires kv_policy='paged'")
        need(self.kv_policy != "static" or self.scheduling_policy == "fcfs", "scheduling_policy",
             "kv_policy='static' batches requests in arrival order only ('fcfs')")
        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        self.structured_outputs_config = _structured_outputs_config(self.structured_outputs_config)
        if self.speculative_config is not None:
            need(self.kv_policy == "paged", "speculative_config", "requires kv_policy='paged'")


def _structured_outputs_config(value: dict | str | None) -> dict:
    import json

    from pagedjax.structured.backend import check_backend_name

    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("structured_outputs_config: must be a dict (or its JSON)")
    unknown = sorted(set(value) - {"backend"})
    if unknown:
        raise ValueError(f"structured_outputs_config: unknown field(s) {', '.join(unknown)}")
    backend = value.get("backend", "auto")
    if not isinstance(backend, str):
        raise ValueError("structured_outputs_config.backend: must be a string")
    check_backend_name(backend)
    return {"backend": backend}
