"""Every attention/cache kernel configuration the engine can pick, compiled for a target.

The engine calls the kernels with default launch parameters, so what it can pick is the
product of the model-side axes (block size, head_dim, GQA group, cache dtype) with what
:mod:`pallas_kernels.tuning` answers for the target's architecture. Configurations that
lower to the same Triton kernel (same tile shapes, dtype, warps, stages; e.g. GQA groups 5-8
all pad to 8 in the ragged kernel) are compiled once and share a report row.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from pagedjax.aot import fingerprint
from pagedjax.aot.resources import KernelResources, compile_with_resources
from pagedjax.aot.target import compile_only_devices
from pallas_kernels import copy_blocks, paged_decode_attention, ragged_paged_attention, tuning, write_kv
from pallas_kernels._common import next_pow2
from pallas_kernels._kv_chunks import chunk_layout, resolve_chunk_tokens
from pallas_kernels.paged_decode_attention import decode_plan
from pallas_kernels.ragged_paged_attention import ragged_block_q, windowed_launch

BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
DTYPES = ("bfloat16", "float16", "float32")
NUM_KV_HEADS = 2
NUM_BLOCKS = 64
# Quantized caches (`kv_cache_dtype`, issue 20): bf16 queries over int8 / FP8 storage at the
# common head dims, page sizes and GQA groups (the kernels differ from the float ones only in
# the widening of loaded tiles and two per-channel scale vectors). FP8 needs sm_89+: the
# engine refuses it on sm80, so the sm80 sweep has int8 only.
KV_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
KV_BLOCK_SIZES = (16, 32, 64)
KV_GROUPS = (1, 4, 8)
# Decode table width: 64 pages gives several flash-decoding splits of several chunks each.
# The split count only sets the grid and a loop-bound constant, so one width covers them.
DECODE_TABLE_PAGES = (64,)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # decode | ragged | write_kv | copy_blocks
    dtype: str
    head_dim: int
    block_size: int
    group: int = 1
    # Launch parameters; None: what pallas_kernels.tuning answers (what the engine gets).
    launch: tuning.KernelTuning | None = None
    softcap: float | None = None  # a static kernel variant (Gemma 2's attention soft-cap)
    windowed: bool = False  # the sliding-window variant (window passed as data)
    kv_dtype: str | None = None  # a quantized cache's storage (None: the cache is `dtype`)

    def tuned(self, arch: str) -> tuning.KernelTuning:
        """The launch the engine gets (windowed or soft-capped ragged variants have their own)."""
        if self.launch is not None:
            return self.launch
        t = tuning.lookup(self.kernel, self.dtype, self.head_dim, arch)
        if self.kv_dtype is not None:
            t = tuning.quantized_launch(t)
        return windowed_launch(t, self.windowed, self.softcap) if self.kernel == "ragged" else t

    def chunk_tokens(self, arch: str) -> int:
        """The chunk size the kernel runs with (the tuned one is capped for small pages)."""
        t = self.tuned(arch)
        if self.launch is not None:
            return t.chunk_tokens
        return resolve_chunk_tokens(None, None, self.block_size, t.chunk_tokens)

    def key(self, arch: str) -> tuple:
        """What determines the compiled Triton kernel (see module docstring)."""
        if self.kernel not in ("decode", "ragged"):
            key = (self.kernel, self.dtype, self.head_dim, self.block_size)
            return key if self.kv_dtype is None else (*key, self.kv_dtype)
        t = self.tuned(arch)
        if self.kernel == "decode":
            group_p, block_q = max(16, next_pow2(self.group)), 1
        else:
            group_p, block_q = next_pow2(self.group), ragged_block_q(None, self.group, t.q_rows)
        key = (self.kernel, self.dtype, self.head_dim, self.block_size, group_p, block_q,
               self.chunk_tokens(arch), t.num_warps, t.num_stages)
        if self.windowed:
            key = (*key, "window")
        if self.kv_dtype is not None:
            key = (*key, self.kv_dtype)
        return key if self.softcap is None else (*key, "softcap")


@dataclasses.dataclass(frozen=True)
class PackedCase:
    """A packed-weight matmul (`pallas_kernels.packed_matmul`, weights kept quantized): bf16
    activations of ``rows`` tokens times a 4096 x 4096 weight of ``bits``-bit codes with one
    scale (and offset) per ``group`` input rows."""

    bits: int
    group: int
    scale_dtype: str
    offset: bool
    rows: int
    kernel: str = "packed_matmul"
    dtype: str = "bfloat16"

    def key(self, arch: str) -> tuple:
        return (self.kernel, self.bits, self.group, self.scale_dtype, self.offset, self.rows)

    def tuned(self, arch: str):
        return None


# The GGUF formats the loader keeps packed (models/packed.py): 4-bit Q4_0/Q4_1 (f16 scale and
# offset) and Q4_K (f32), 8-bit Q8_0/Q5_0 (f16, no offset), Q5_1 (f16 offset), Q6_K/Q3_K
# (group 16, f32), Q5_K/Q2_K (f32 offset) and int8 per channel (one group, f32); decode
# (1 row) and batched (64 rows) launches.
PACKED_FORMATS = ((4, 32, "float16", True), (4, 32, "float32", True), (8, 32, "float16", False),
                  (8, 32, "float16", True), (8, 16, "float32", False), (8, 32, "float32", True),
                  (8, 16, "float32", True), (8, 4096, "float32", False))


def engine_cases(arch: str = "sm90") -> list[KernelCase]:
    cases = [KernelCase(k, dt, d, bs, g) for k, dt, d, bs, g in itertools.product(
        ("decode", "ragged"), DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS)]
    cases += [KernelCase(k, dt, d, bs) for k, dt, d, bs in itertools.product(
        ("write_kv", "copy_blocks"), DTYPES, HEAD_DIMS, BLOCK_SIZES)]
    # Sliding-window variants (Mistral, Phi-3, Qwen2, Gemma 2/3: windowed layers) over every
    # shape of the engine sweep, and soft-capped windowed ones (Gemma 2: a tanh on every logit
    # tile) at the head dims and groups of the families that use them.
    cases += [KernelCase(k, dt, d, bs, g, windowed=True) for k, dt, d, bs, g in itertools.product(
        ("decode", "ragged"), DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS)]
    cases += [KernelCase(k, dt, d, bs, g, softcap=50.0, windowed=True)
              for k, dt, d, bs, g in itertools.product(
                  ("decode", "ragged"), DTYPES, (128, 256), (16, 32), (1, 2))]
    kv_dtypes = KV_DTYPES if arch != "sm80" else ("int8",)
    cases += [KernelCase(k, "bfloat16", d, bs, g, kv_dtype=kv)
              for k, kv, d, bs, g in itertools.product(
                  ("decode", "ragged"), kv_dtypes, HEAD_DIMS, KV_BLOCK_SIZES, KV_GROUPS)]
    cases += [KernelCase("write_kv", "bfloat16", d, bs, kv_dtype=kv)
              for kv, d, bs in itertools.product(kv_dtypes, HEAD_DIMS, KV_BLOCK_SIZES)]
    cases += [PackedCase(*fmt, rows) for fmt in PACKED_FORMATS for rows in (1, 64)]
    return cases


def _lower_packed(case: PackedCase, device):
    from pallas_kernels.packed_matmul import packed_matmul

    S = functools.partial(jax.ShapeDtypeStruct, sharding=SingleDeviceSharding(device))
    k = n = 4096
    p = {"codes": S((k // 2 if case.bits == 4 else k, n), jnp.uint8 if case.bits == 4
                    else jnp.int8),
         "scale": S((k // case.group, n), jnp.dtype(case.scale_dtype))}
    if case.offset:
        p["offset"] = S((k // case.group, n), jnp.dtype(case.scale_dtype))
    with jax.default_device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(lambda x, p: packed_matmul(x, p, backend="pallas")).lower(
            S((case.rows, k), jnp.bfloat16), p)


def _lower(case: KernelCase, device, table_pages: int, arch: str):
    if isinstance(case, PackedCase):
        return _lower_packed(case, device)
    dt = jnp.dtype(case.dtype)
    sh = SingleDeviceSharding(device)
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sh)
    hq = NUM_KV_HEADS * case.group
    cache = S((2, NUM_KV_HEADS, NUM_BLOCKS, case.block_size, case.head_dim),
              jnp.dtype(case.kv_dtype) if case.kv_dtype else dt)
    i32 = jnp.int32
    # A quantized cache's scales [2, Hkv, D]: an argument (a constant would fold away).
    quant = {} if case.kv_dtype is None else dict(
        kv_scale=S((2, NUM_KV_HEADS, case.head_dim), jnp.float32))
    launch = {}
    if case.launch is not None:
        t = case.launch
        launch = dict(num_warps=t.num_warps, num_stages=t.num_stages, chunk_tokens=t.chunk_tokens)
        if case.kernel == "ragged":
            launch["block_q"] = ragged_block_q(None, case.group, t.q_rows)
    if case.kernel == "decode":
        fn = lambda q, k, v, bt, lens, layer, w, **sc: paged_decode_attention(
            q, k, v, bt, lens, scale=0.1, layer=layer, backend="pallas", softcap=case.softcap,
            window=w if case.windowed else None, **launch, **sc)
        args = (S((4, hq, case.head_dim), dt), cache, cache, S((4, table_pages), i32),
                S((4,), i32), S((), i32), S((), i32))
    elif case.kernel == "ragged":
        fn = lambda q, k, v, kl, bt, cu, n, layer, w, **sc: ragged_paged_attention(
            q, k, v, kl, bt, cu, n, scale=0.1, layer=layer, backend="pallas",
            softcap=case.softcap, window=w if case.windowed else None, **launch, **sc)
        args = (S((64, hq, case.head_dim), dt), cache, cache, S((8,), i32), S((8, 16), i32),
                S((9,), i32), S((), i32), S((), i32), S((), i32))
    elif case.kernel == "write_kv":
        tok = S((32, NUM_KV_HEADS, case.head_dim), dt)
        fn = lambda k, v, kc, vc, slots, layer, **sc: write_kv(
            k, v, kc, vc, slots, layer=layer, backend="pallas", **sc)
        args = (tok, tok, cache, cache, S((32,), i32), S((), i32))
    else:
        fn = lambda kc, vc, m: copy_blocks(kc, vc, m, backend="pallas")
        args = (cache, cache, S((8, 2), i32))
    with jax.default_device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Pallas-Triton deprecation
        return jax.jit(fn).lower(*args, **quant)


def compile_case(case: KernelCase, target: str, arch: str, compile: bool = True,
                 previous: dict | None = None) -> dict:
    """Lower one configuration and compile it; a row per table width, each with the IR
    digest and a row per Triton kernel in it (XLA glue is dropped).

    ``previous``: the committed entry of this configuration; a row whose IR digest it
    matches is taken from it (same IR and toolchain: the same compile). ``compile`` False
    leaves the other rows lowered only (``kernels`` None), for a fingerprint check."""
    device = compile_only_devices(target)[0]
    rows = []
    widths = DECODE_TABLE_PAGES if case.kernel == "decode" else (0,)
    old_rows = {r["table_pages"]: r for r in (previous or {}).get("rows", [])}
    for pages in widths:
        t0 = time.perf_counter()
        ir, kernels, error = None, {}, None
        try:
            lowered = _lower(case, device, pages, arch)
            ir = fingerprint.digest(lowered)
        except Exception as e:  # reported, and fails the tier
            error = f"{type(e).__name__}: {str(e)[:3000]}"
        old = old_rows.get(pages)
        if error is None and old is not None and old.get("ir") == ir and not old["error"]:
            rows.append(dict(old, reused=True))
            continue
        if error is None and not compile:
            rows.append(dict(table_pages=pages, ir=ir, compile_s=0.0, error=None,
                             kernels=None, extra=_launch_extra(case, arch, pages)))
            continue
        if error is None:
            try:
                _, kernels, _ = compile_with_resources(lowered)
            except Exception as e:
                error = f"{type(e).__name__}: {str(e)[:3000]}"
        seconds = time.perf_counter() - t0
        mine = [r for n, r in kernels.items() if _is_ours(n)]
        rows.append(dict(table_pages=pages, ir=ir, compile_s=round(seconds, 3), error=error,
                         kernels=[_row(r) for r in mine], extra=_launch_extra(case, arch, pages)))
        if error is None and not mine:
            rows[-1]["error"] = "no Triton kernel found in the compiled executable"
    return dict(rows=rows)


def _is_ours(name: str) -> bool:
    return name.startswith(("paged_decode", "ragged_paged_attention", "write_kv", "copy_blocks",
                            "packed_matmul"))


def _row(r: KernelResources) -> dict:
    return dict(name=r.name, registers=r.registers, spill_stores=r.spill_stores,
                spill_loads=r.spill_loads, stack_bytes=r.stack_bytes, local_bytes=r.local_bytes,
                static_smem=r.static_smem, dynamic_smem=r.dynamic_smem, threads=r.threads,
                grid=list(r.grid))


def _launch_extra(case: KernelCase, arch: str, pages: int) -> dict:
    if isinstance(case, PackedCase) or case.kernel not in ("decode", "ragged"):
        return {}
    t = case.tuned(arch)
    chunk = case.chunk_tokens(arch)
    ppc, cpp = chunk_layout(case.block_size, chunk)
    extra = dict(num_warps=t.num_warps, num_stages=t.num_stages, chunk_tokens=chunk,
                 pages_per_chunk=ppc, chunks_per_page=cpp)
    if case.kernel == "decode":
        splits, _, _ = decode_plan(4, NUM_KV_HEADS, pages, case.block_size, chunk, None)
        extra["num_splits"] = splits
    else:
        extra["block_q"] = ragged_block_q(None, case.group, t.q_rows)
    return extra


def sweep(target: str, cases: list[KernelCase] | None = None, log=print,
          reuse: dict | None = None, compile: Callable[[tuple], bool] | bool = True) -> dict:
    """Lower every distinct configuration once, and compile it.

    Returns ``{"configs": [...], "compiled": [...]}``: each engine configuration names the
    index of its compiled kernel, and each compiled entry has its rows (one per table width
    for decode) with the IR digest, registers, spills, shared memory and compile time.

    ``reuse``: a previous sweep of the same toolchain; entries whose IR digests match are
    taken from it instead of compiled again. ``compile``: a predicate on the key (or a
    bool); entries it refuses are lowered only (the compile tier's check compiles a sample).
    """
    arch = tuning.arch_of(compile_only_devices(target)[0].device_kind)
    cases = engine_cases(arch) if cases is None else cases
    previous = {tuple(c["key"]): c for c in (reuse or {}).get("compiled", [])}
    wanted = compile if callable(compile) else (lambda key: compile)
    index: dict[tuple, int] = {}
    compiled: list[dict] = []
    configs = []
    for case in cases:
        key = case.key(arch)
        if key not in index:
            index[key] = len(compiled)
            entry = compile_case(case, target, arch, compile=wanted(key),
                                 previous=previous.get(key))
            reused = all([r.pop("reused", False) for r in entry["rows"]])
            compiled.append(dict(key=list(key), **entry))
            worst = max((k["registers"] for r in entry["rows"] for k in r["kernels"] or ()),
                        default=0)
            bad = any(r["error"] for r in entry["rows"])
            state = ("ERROR" if bad else "lowered" if entry["rows"][0]["kernels"] is None
                     else "ok")
            log(f"  {target} {key} regs<={worst} {state}{' (reused)' if reused else ''}")
        if isinstance(case, PackedCase):
            configs.append(dict(kernel=case.kernel, dtype=case.dtype, bits=case.bits,
                                group=case.group, scale_dtype=case.scale_dtype,
                                offset=case.offset, rows=case.rows, compiled=index[key]))
            continue
        configs.append(dict(kernel=case.kernel, dtype=case.dtype, head_dim=case.head_dim,
                            block_size=case.block_size, group=case.group, compiled=index[key],
                            **({"softcap": case.softcap} if case.softcap else {}),
                            **({"windowed": True} if case.windowed else {}),
                            **({"kv_dtype": case.kv_dtype} if case.kv_dtype else {})))
    return dict(arch=arch, configs=configs, compiled=compiled)
