"""The engine's whole jitted step, compiled for a compile-only GPU at real model shapes.

`ModelRunner.compile_only` builds the same runner the engine serves with (same model, same
attention, same TP sharding) minus device state, and `_step` is lowered on
ShapeDtypeStructs, so an 8B model compiles on a laptop-sized CPU host with no weights.
Buckets follow `build_step_inputs` (what the scheduler can hand the runner): decode at
several batch sizes, a prefill, and a mixed prefill-chunk + decode step; the sampler's
jitted `sample` is compiled at the matching row buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from models.config import ModelConfig
from pagedjax.aot import fingerprint
from pagedjax.aot.resources import compile_with_resources
from pagedjax.aot.target import compile_only_devices
from pagedjax.config import EngineConfig
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, sample
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedjax.worker.model_runner import ModelRunner, default_layer_loop
from pagedjax.worker.step_inputs import build_step_inputs

MODELS = {
    # SmolLM2-135M-Instruct, the demo model.
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True),
    # Meta-Llama-3-8B: 32 layers, 32 query / 8 KV heads of 128, llama3 rope scaling.
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
        max_position_embeddings=8192),
    # Gemma-2-9B: 42 layers alternating 4096-token windows and full attention, 16 query /
    # 8 KV heads of 256, logit soft-capping in attention (50) and at the head (30).
    "gemma2-9b": ModelConfig(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42,
        num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, architecture="gemma2",
        attn_scale=256 ** -0.5, attn_softcap=50.0, final_softcap=30.0,
        layer_windows=tuple(4096 if i % 2 == 0 else 0 for i in range(42)),
        hidden_act="gelu_tanh", sandwich_norm=True, embed_scale=True),
}


@dataclasses.dataclass(frozen=True)
class StepShape:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (new tokens, context length incl. them) per sequence


def step_shapes(max_model_len: int) -> list[StepShape]:
    """Decode at batch 1/64/256 (short and max-length contexts), a 2048-token prefill, and a
    mixed step (a 512-token prefill chunk at a 1024 offset + 63 decode rows)."""
    return [
        StepShape("decode_b1", ((1, max_model_len),)),
        StepShape("decode_b64", ((1, 700),) * 64),
        StepShape("decode_b256", ((1, max_model_len // 2),) * 256),
        StepShape("prefill_2048", ((2048, 2048),)),
        StepShape("mixed_512+63", ((512, 1536),) + ((1, 900),) * 63),
    ]


def _inputs(shape: StepShape, runner: ModelRunner):
    bs = runner.block_size
    sched, nxt = [], 0
    for i, (q, ctx) in enumerate(shape.seqs):
        pages = math.ceil(ctx / bs)
        table = list(range(nxt, nxt + pages))
        nxt += pages
        sched.append(ScheduledSeq(i, "aot", [0] * q, ctx - q, table, True))
    return build_step_inputs(sched, bs, runner.max_blocks_per_seq, plan=runner.shape_plan,
                             num_groups=runner.num_kv_groups), nxt


def _sampler(logit_rows: int, rows: int, vocab: int, max_model_len: int, device,
             compile: bool = True) -> dict:
    """The sampler compiles once per (logits rows, batch) pair; later steps reuse it."""
    key = (logit_rows, rows, vocab, max_model_len, device, compile)
    fresh = key not in _seen
    _seen.add(key)
    return dict(_sampler_report(*key), _fresh=fresh)


_seen: set = set()


def _abstract(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def compile_step(model: str, target: str, dtype=jnp.bfloat16, tp: int = 1, block_size: int = 16,
                 max_model_len: int = 4096, shapes: list[StepShape] | None = None,
                 log=print, kv_cache_dtype: str = "auto", layer_loop: str | None = None,
                 compile: Callable[[dict], bool] | bool = True) -> list[dict]:
    """Compile the runner's step (and the sampler) for every shape; a report row each.

    ``layer_loop`` None compiles the loop the engine picks for a GPU, whatever
    $PAGEDJAX_LAYER_LOOP says (the test suite sets it to "scan" for its CPU compiles).
    ``compile``: a predicate on the row (model, tp, shape, ...) or a bool; rows it refuses
    are lowered only, their compile fields None (the compile tier's check, which compiles
    a sample and compares every row's IR digest)."""
    wanted = compile if callable(compile) else (lambda row: compile)
    config = MODELS[model]
    devices = compile_only_devices(target, tp)
    if layer_loop is None:
        layer_loop = default_layer_loop("gpu", tp)
    engine_config = EngineConfig(block_size=block_size, tensor_parallel_size=tp,
                                 attention_backend="pallas", num_gpu_blocks=1,
                                 max_num_seqs=256, max_num_batched_tokens=2048,
                                 kv_cache_dtype=kv_cache_dtype, layer_loop=layer_loop)
    runner = ModelRunner.compile_only(config, engine_config, dtype, max_model_len, devices)
    rows = []
    for shape in shapes or step_shapes(max_model_len):
        inputs, pages = _inputs(shape, runner)
        params, k_cache, v_cache = runner.abstract_state(max(pages, 64))
        rep = (SingleDeviceSharding(devices[0]) if runner.mesh is None
               else jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec()))
        host = (inputs.input_ids, inputs.positions, runner.step_meta(inputs.meta),
                inputs.logits_indices)
        args = jax.tree.map(lambda x, rep=rep: _abstract(jnp.asarray(x), rep), host)
        t0 = time.perf_counter()
        row = dict(model=model, target=target, tp=tp, dtype=jnp.dtype(dtype).name,
                   **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}),
                   block_size=block_size, shape=shape.name, tokens=int(inputs.input_ids.shape[0]),
                   seqs=len(shape.seqs), table_width=int(inputs.meta.block_tables.shape[-1]),
                   decode_only=bool(inputs.meta.decode_only), layer_loop=layer_loop)
        do_compile = wanted(row)
        row["ir"], kernels, row["error"], row["temp_mib"] = None, {}, None, None
        try:
            with jax.default_device(devices[0]), warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                lowered = ModelRunner._step.lower(runner, params, k_cache, v_cache, *args)
                row["ir"] = fingerprint.digest(lowered)
                if do_compile:
                    compiled, kernels, _ = compile_with_resources(lowered)
                    # Scratch memory of the step: under a layer scan it holds a copy of each
                    # layer's weights (resolve_layer_loop's docstring), unrolled activations.
                    row["temp_mib"] = round(
                        compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
        except Exception as e:
            kernels, row["error"] = {}, f"{type(e).__name__}: {str(e)[:3000]}"
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        row.update(_kernel_fields(kernels))
        if not do_compile and row["error"] is None:
            row.update(dict.fromkeys(STEP_COMPILE_FIELDS))
        # The engine's sampler batch (LLMEngine._sample_batch): the step's sequence bucket
        # for decodes, the largest bucket otherwise.
        batch = inputs.shape_key[1] if inputs.meta.decode_only else runner.shape_plan.seq_cap
        row.update(_sampler(len(inputs.logits_indices), batch, config.vocab_size,
                            max_model_len, devices[0], compile=do_compile))
        row["sampler_compile_s"] = row["sampler_compile_s"] if row.pop("_fresh") else 0.0
        log(f"  {target} {model} tp={tp} kv={kv_cache_dtype} {shape.name}: {row['compile_s']} s, "
            f"{row['kernels']} kernels, spills in {row['spilling'] or 'none'}"
            f"{'  ERROR ' + row['error'][:200] if row['error'] else ''}")
        rows.append(row)
    return rows


# What only a compile tells (None in a row that was lowered only).
STEP_COMPILE_FIELDS = ("temp_mib", "kernels", "max_registers", "spilling", "max_smem",
                       "attention_kernels", "sampler_error", "sampler_spilling")


def _kernel_fields(kernels: dict) -> dict:
    return dict(kernels=len(kernels),
                max_registers=max((k.registers for k in kernels.values()), default=0),
                spilling=sorted(n for n, k in kernels.items() if k.spills),
                max_smem=max((k.smem for k in kernels.values()), default=0),
                attention_kernels=sorted(n for n in kernels if n.startswith(
                    ("paged_decode", "ragged_paged", "write_kv"))))


def compile_swap(model: str, target: str, dtype=jnp.bfloat16, block_size: int = 16,
                 num_blocks: int = 1024, blocks: int = 64, log=print) -> list[dict]:
    """The swap path's device halves (gather of the blocks to swap out, donated scatter of
    the blocks swapped in) at the model's full cache shape."""
    from pallas_kernels import swap

    c = MODELS[model]
    device = compile_only_devices(target)[0]
    sh = SingleDeviceSharding(device)
    cache = jax.ShapeDtypeStruct((c.num_layers, c.num_kv_heads, num_blocks, block_size,
                                  c.head_dim), dtype, sharding=sh)
    moved = jax.ShapeDtypeStruct((c.num_layers, c.num_kv_heads, blocks, block_size, c.head_dim),
                                 dtype, sharding=sh)
    ids = jax.ShapeDtypeStruct((blocks,), jnp.int32, sharding=sh)
    rows = []
    for name, fn, args in (("swap_out", swap._gather, (cache, cache, ids)),
                           ("swap_in", swap._scatter, (cache, cache, moved, moved, ids))):
        t0 = time.perf_counter()
        ir = None
        try:
            with jax.default_device(device):
                lowered = fn.lower(*args)
                ir = fingerprint.digest(lowered)
                _, kernels, _ = compile_with_resources(lowered)
            err = None
        except Exception as e:
            kernels, err = {}, f"{type(e).__name__}: {str(e)[:2000]}"
        rows.append(dict(model=model, target=target, tp=1, dtype=jnp.dtype(dtype).name,
                         block_size=block_size, shape=f"{name}_{blocks}_blocks", ir=ir,
                         error=err, compile_s=round(time.perf_counter() - t0, 2),
                         **_kernel_fields(kernels), sampler_rows=0, sampler_ir=None,
                         sampler_compile_s=0.0, sampler_error=None, sampler_spilling=[]))
        log(f"  {target} {model} {name}: {rows[-1]['compile_s']} s, spills in "
            f"{rows[-1]['spilling'] or 'none'}{'  ERROR ' + err[:200] if err else ''}")
    return rows


@functools.cache
def _sampler_report(logit_rows: int, rows: int, vocab: int, max_model_len: int, device,
                    compile: bool = True) -> dict:
    """Compile the engine's `sample` variant with penalty histories and bans (the larger
    one): greedy, top-k/top-p/min-p, penalties, min_tokens, logit_bias, a structured-output
    token bitmask, top-20 logprobs (the widths `LLMEngine._sampling_metadata` uses)."""
    params = [SamplingParams(temperature=0.0, min_tokens=2, logit_bias={5: 1.0}),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                             presence_penalty=0.5, repetition_penalty=1.1)]
    states = [SeqSamplingState([1, 2, 3], [4, 5], 0, 0), SeqSamplingState([1], [2], 1, 0)]
    words = -(-vocab // 32)
    meta = SamplingMetadata.from_params(list(zip(params, states))[:rows], pad_to=rows,
                                        vocab_size=vocab, eos_token_ids=[2],
                                        history_width=max_model_len, ban_width=2048,
                                        masks={0: np.full(words, -1, np.int32)},
                                        mask_width=words, bias_width=512)
    sh = SingleDeviceSharding(device)
    abstract = jax.tree.map(lambda x: _abstract(jnp.asarray(x), sh), meta)
    logits = jax.ShapeDtypeStruct((logit_rows, vocab), jnp.float32, sharding=sh)
    src = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sh)
    t0 = time.perf_counter()
    ir, kernels, err = None, {}, None
    try:
        with jax.default_device(device):
            # `chunked`: the two-stage top-k a GPU runner samples with (`chunked_top_k`).
            lowered = sample.lower(logits, abstract, num_logprobs=MAX_LOGPROBS, rows=src,
                                   chunked=True)
            ir = fingerprint.digest(lowered)
            if compile:
                _, kernels, _ = compile_with_resources(lowered)
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:2000]}"
    spilling = sorted(n for n, k in kernels.items() if k.spills)
    return dict(sampler_rows=rows, sampler_ir=ir,
                sampler_compile_s=round(time.perf_counter() - t0, 2),
                sampler_error=err if compile or err else None,
                sampler_spilling=spilling if compile or err else None)
