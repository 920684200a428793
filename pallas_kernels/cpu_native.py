"""Native ragged paged attention for XLA:CPU (`csrc/paged_attention_cpu.cc`, an XLA FFI call).

Pallas has no CPU backend, and XLA can only express paged attention by gathering every
sequence's K/V through its table into a dense copy whose size follows the padded table width
(1.3-7x slower per layer than this kernel on 2 CPU cores, `bench/cpu_attention.py`). The
native kernel reads blocks in place through the table, so its cost follows real lengths, and
one block-table width serves every step (`ShapePlan.fixed_width`). It is the CPU engine's attention
(`backend="cpu"`, picked automatically on CPU when it builds); `backend="xla"` keeps the
pure-jnp reference, which the tests compare it against.

The library is compiled on first use with the system C++ compiler (`$CXX`, else `c++`)
against the FFI headers jaxlib ships, into a cache keyed by source, flags, jaxlib version and
host (`$PAGEDJAX_CACHE_DIR`, default ``~/.cache/pagedjax``; the temporary directory when that
is not writable). Built for the host CPU
(``-march=native``): the cache lives on the machine that runs it. ``PAGEDJAX_NATIVE_CPU=0``
turns it off (the XLA path then serves CPU).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import data_slots, is_quantized

logger = logging.getLogger(__name__)

ENV_DISABLE = "PAGEDJAX_NATIVE_CPU"
ENV_CACHE = "PAGEDJAX_CACHE_DIR"
TARGET = "pagedjax_ragged_paged_attention_cpu"
WRITE_TARGET = "pagedjax_write_kv_bytes_cpu"
PACKED_TARGET = "pagedjax_packed_matmul_cpu"
DENSE_TARGET = "pagedjax_dense_matmul_cpu"
DENSE_LIVE_TARGET = "pagedjax_dense_matmul_live_cpu"
DENSE_SILU_MUL_TARGET = "pagedjax_dense_matmul_silu_mul_cpu"
ZEROS_TARGET = "pagedjax_zeros_huge_pages_cpu"
GREEDY_TARGET = "pagedjax_greedy_rows_cpu"
LM_HEAD_GREEDY_TARGET = "pagedjax_lm_head_greedy_cpu"
LM_HEAD_GREEDY_INT8_TARGET = "pagedjax_lm_head_greedy_int8_cpu"
SAMPLE_TARGET = "pagedjax_sample_rows_cpu"
ADD_RMS_NORM_TARGET = "pagedjax_add_rms_norm_cpu"
RMS_NORM_TARGET = "pagedjax_rms_norm_cpu"
# One library: the attention kernel (and its FP8 byte scatter), the packed-weight matmul,
# the float32 panel matmul, the KV cache's zero fill on huge pages, greedy sampling, greedy
# tokens from hidden states through a screened LM head, sampled tokens, and the residual add
# with RMSNorm.
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention_cpu.cc", "packed_matmul_cpu.cc",
                             "dense_matmul_cpu.cc", "zeros_huge_pages_cpu.cc",
                             "greedy_rows_cpu.cc", "lm_head_greedy_cpu.cc",
                             "sample_rows_cpu.cc", "add_rms_norm_cpu.cc", "cpu_isa.cc"))
HEADERS = (Path(__file__).with_name("csrc") / "row_math.h",)
SOURCE = SOURCES[0]
# Reassociation lets GCC vectorise the dot products and sums. Not -ffast-math: linking a
# shared library with it pulls in crtfastmath.o, which turns on flush-to-zero for the whole
# process when the library loads (hypothesis noticed: subnormal floats vanished).
FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
DTYPES = (jnp.float32, jnp.bfloat16)


class NativeBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path() -> Path:
    import jaxlib

    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)
                         + " ".join(FLAGS).encode()
                         + jaxlib.__version__.encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "pagedjax")
    return root / "native" / f"paged_attention_cpu-{key}.so"


def build(force: bool = False) -> Path:
    """Compile the library if its cached copy is missing; return its path.

    Concurrent builders (pytest-xdist workers) each compile to a private temporary file and
    rename it into place, so a reader never sees a half-written library."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = _compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (set $CXX)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: build under the temporary directory instead
        out = Path(tempfile.gettempdir()) / "pagedjax-native" / out.name
        if out.exists() and not force:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        os.unlink(tmp)
        raise NativeBuildError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    if proc.returncode:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


@functools.cache
def _register() -> bool:
    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(lib.PagedjaxRaggedPagedAttentionCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        WRITE_TARGET, jax.ffi.pycapsule(lib.PagedjaxWriteKvBytesCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        PACKED_TARGET, jax.ffi.pycapsule(lib.PagedjaxPackedMatmulCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        DENSE_TARGET, jax.ffi.pycapsule(lib.PagedjaxDenseMatmulCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        DENSE_LIVE_TARGET, jax.ffi.pycapsule(lib.PagedjaxDenseMatmulLiveCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        DENSE_SILU_MUL_TARGET, jax.ffi.pycapsule(lib.PagedjaxDenseMatmulSiluMulCpu),
        platform="cpu")
    jax.ffi.register_ffi_target(
        ZEROS_TARGET, jax.ffi.pycapsule(lib.PagedjaxZerosHugePagesCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        GREEDY_TARGET, jax.ffi.pycapsule(lib.PagedjaxGreedyRowsCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        LM_HEAD_GREEDY_TARGET, jax.ffi.pycapsule(lib.PagedjaxLmHeadGreedyCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        LM_HEAD_GREEDY_INT8_TARGET, jax.ffi.pycapsule(lib.PagedjaxLmHeadGreedyInt8Cpu),
        platform="cpu")
    jax.ffi.register_ffi_target(
        SAMPLE_TARGET, jax.ffi.pycapsule(lib.PagedjaxSampleRowsCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        ADD_RMS_NORM_TARGET, jax.ffi.pycapsule(lib.PagedjaxAddRmsNormCpu), platform="cpu")
    jax.ffi.register_ffi_target(
        RMS_NORM_TARGET, jax.ffi.pycapsule(lib.PagedjaxRmsNormCpu), platform="cpu")
    return True


ISA_BITS = {"avx512f": 1, "avx512bf16": 2, "avx2_fma": 4, "avx512vnni": 8}


@functools.cache
def compiled_isa() -> frozenset[str]:
    """The vector paths the native library was compiled with (`csrc/cpu_isa.cc`): a subset of
    ``ISA_BITS`` (empty: portable loops only). Built with ``-march=native``, so the host's."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    bits = ctypes.cdll.LoadLibrary(str(build())).PagedjaxCpuIsa()
    return frozenset(name for name, bit in ISA_BITS.items() if bits & bit)


@functools.cache
def lm_head_amx() -> bool:
    """Whether `lm_head_greedy_cpu` screens with AMX tiles here: built for a host with AMX-BF16
    and allowed the tile state by Linux; 4 rows or more (``PAGEDJAX_LM_HEAD_AMX=0`` still turns
    it off, read on every call)."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    return bool(ctypes.cdll.LoadLibrary(str(build())).PagedjaxLmHeadAmx())


@functools.cache
def available() -> bool:
    """True when the library builds and registers (once per process); False, with the reason
    logged, when it cannot or ``PAGEDJAX_NATIVE_CPU=0``."""
    if os.environ.get(ENV_DISABLE, "1") in ("0", "false", "False"):
        return False
    try:
        return _register()
    except (NativeBuildError, OSError, AttributeError) as e:
        logger.warning("native CPU attention unavailable, using the XLA path: %s", e)
        return False


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """fp32 / bf16 queries over a cache of their dtype, or an int8 / FP8 one (static scales)."""
    return (any(q.dtype == d for d in DTYPES) and k_cache.ndim == 5
            and (q.dtype == k_cache.dtype or is_quantized(k_cache.dtype)))


def ragged_paged_attention_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               kv_lens: jax.Array, block_tables: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array, layer: jax.Array,
                               window: jax.Array | int = 0, kv_scale: jax.Array | None = None,
                               *, scale: float, softcap: float | None = None,
                               token_scales: bool = False) -> jax.Array:
    """Same contract as `ragged_paged_attention_ref` (5-D caches, int32 metadata);
    ``kv_scale [2, Hkv, D]`` for an int8 / FP8 cache; ``token_scales``: the cache also holds
    per-token factors (`kv_quant`, granularity "per_token")."""
    if not _register():
        raise NativeBuildError("native CPU attention is not available")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    scales = (jnp.zeros((0,), jnp.float32) if kv_scale is None
              else jnp.asarray(kv_scale, jnp.float32))
    return call(q, k_cache, v_cache, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
                i32(num_seqs).reshape(()), i32(layer).reshape(()), i32(window).reshape(()),
                scales, scale=np.float32(scale), softcap=np.float32(softcap or 0.0),
                data_slots=np.int64(data_slots(k_cache.shape[0], k_cache.shape[-1])
                                    if token_scales else 0))


def write_kv_bytes_cpu(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                       slot_mapping: jax.Array, layer: jax.Array,
                       factors: tuple[jax.Array, jax.Array] | None = None,
                       ) -> tuple[jax.Array, jax.Array]:
    """Scatter already-quantized 1-byte ``k``/``v`` ``[T, Hkv, D]`` (the cache's dtype) into
    5-D caches in place (aliased); slots < 0 are padding. For FP8 caches, whose scatter
    XLA:CPU runs by widening the whole cache (`write_kv`), and per-token caches, whose
    ``factors`` (K's and V's ``[T, Hkv]`` float32) go into the factor slots (`kv_quant`)."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    call = jax.ffi.ffi_call(WRITE_TARGET, (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                                           jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
                            input_output_aliases={2: 0, 3: 1})
    none = jnp.zeros((0,), jnp.float32)
    kf, vf = (none, none) if factors is None else (jnp.asarray(f, jnp.float32)
                                                   for f in factors)
    n = 0 if factors is None else data_slots(k_cache.shape[0], k_cache.shape[-1])
    return call(k, v, k_cache, v_cache, jnp.asarray(slot_mapping, jnp.int32),
                jnp.asarray(layer, jnp.int32).reshape(()), kf, vf, data_slots=np.int64(n))


def packed_matmul_cpu(x: jax.Array, p: dict, n: int | None = None,
                      live_rows: jax.Array | None = None, silu_mul: bool = False) -> jax.Array:
    """``x [..., K] @ w`` for a packed weight ``p`` (`models.qlinear`: ``codes``, ``scale``,
    optional ``offset``; canonical ``[rows, N]`` or 64-column panels ``[N / 64, rows, 64]``,
    whose true width ``n`` must be given), widening the weight row by row in registers
    (`csrc/packed_matmul_cpu.cc`) instead of materialising it. fp32 or bf16 ``x``. A float32
    weight in panels (``{"panels"}``, `models.qlinear.to_dense_panels`) goes to
    `dense_matmul_cpu`, with ``live_rows`` and ``silu_mul`` (see there; packed codes multiply
    every row, and their ``silu_mul`` is XLA's silu of the first half times the second)."""
    if "panels" in p:
        return dense_matmul_cpu(x, p["panels"], n, live_rows, silu_mul)
    if silu_mul:
        y = packed_matmul_cpu(x, p, n)
        half = y.shape[-1] // 2
        return jax.nn.silu(y[..., :half]) * y[..., half:]
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    lead, k = x.shape[:-1], x.shape[-1]
    codes = p["codes"]
    n = codes.shape[-1] if codes.ndim == 2 else n
    if n is None:
        raise ValueError("packed_matmul_cpu: panels need the output width n")
    offset = p.get("offset")
    if offset is None:
        offset = jnp.zeros((0,), p["scale"].dtype)
    call = jax.ffi.ffi_call(PACKED_TARGET, jax.ShapeDtypeStruct((math.prod(lead), n), x.dtype))
    # int8 codes go in as they are (a bitcast to uint8 would copy the weight on XLA:CPU).
    y = call(x.reshape(-1, k), codes, p["scale"], offset, is_signed=codes.dtype == jnp.int8)
    return y.reshape(*lead, n)


def dense_matmul_cpu(x: jax.Array, panels: jax.Array, n: int,
                     live_rows: jax.Array | None = None, silu_mul: bool = False) -> jax.Array:
    """``x [..., K] @ w`` for a float32 weight ``w [K, n]`` held as 64-column panels
    ``[ceil(n / 64), K, 64]`` (`models.qlinear.to_dense_panels`; `csrc/dense_matmul_cpu.cc`
    says why: up to six rows cost one pass over the weight, where XLA's GEMM packs it per
    call). float32 only; each row's result does not depend on how many rows come with it.

    ``live_rows`` (an int32 scalar, traced): only the first that many rows of ``x`` (flattened
    to ``[M, K]``) are multiplied and the rest of the result is zeros, so a step padded to its
    token bucket pays for its real tokens only (`models.decoder.DecoderLM` passes
    ``cu_q_lens[num_seqs]``).

    ``silu_mul``: ``w`` is an MLP's fused gate and up weight ``[K, n]`` (gate the first
    ``n / 2`` columns; ``n`` a multiple of 128, so each half is whole panels) and the result
    ``silu(x @ gate) * (x @ up)`` ``[..., n / 2]``, in one call: the product is combined while
    it is in cache (`csrc/dense_matmul_cpu.cc` says why and how silu is computed)."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise TypeError(f"dense_matmul_cpu: float32 only, got x {x.dtype}, w {panels.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    if silu_mul:
        if n % 128 or panels.shape[0] != n // 64:
            raise ValueError(f"dense_matmul_cpu: silu_mul wants n a multiple of 128 and n / 64 "
                             f"panels, got n={n}, panels {panels.shape}")
        out = jax.ShapeDtypeStruct((math.prod(lead), n // 2), x.dtype)
        live = jnp.asarray(math.prod(lead) if live_rows is None else live_rows,
                           jnp.int32).reshape(())
        return jax.ffi.ffi_call(DENSE_SILU_MUL_TARGET, out)(
            x.reshape(-1, k), panels, live).reshape(*lead, n // 2)
    out = jax.ShapeDtypeStruct((math.prod(lead), n), x.dtype)
    if live_rows is None:
        return jax.ffi.ffi_call(DENSE_TARGET, out)(x.reshape(-1, k), panels).reshape(*lead, n)
    live = jnp.asarray(live_rows, jnp.int32).reshape(())
    return jax.ffi.ffi_call(DENSE_LIVE_TARGET, out)(x.reshape(-1, k), panels,
                                                    live).reshape(*lead, n)


# Where the native norm pays (the demo model, 2-core Zen 4, `bench/offline_throughput.py
# --engines pagedjax-xla-norm,pagedjax`): at 64 rows its one call saved the thunks' dispatch,
# 1.015-1.034x a run of 64 x 128; at 256 rows a norm is bound by moving its ~2.4 MB of rows,
# XLA's four thunks did that as fast, and the native call ran 0.96-0.98x (docs/v1-core.md,
# stop 83). Row counts are static in a compiled step, so the choice costs nothing at run time.
NATIVE_NORM_MAX_ROWS = 128


def add_rms_norm_cpu(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                     eps: float) -> tuple[jax.Array, jax.Array]:
    """``(x + delta, rms_norm(x + delta) * weight)`` over the last axis in one native call
    (`csrc/add_rms_norm_cpu.cc` says why: XLA:CPU makes four thunks of a norm), the CPU's
    `models.decoder.DecoderLM.norm_fn`. ``delta`` None: no add, the first output is ``x``.
    float32 steps of up to `NATIVE_NORM_MAX_ROWS` rows only; other dtypes and larger steps
    take the jnp reference (`pallas_kernels.add_rms_norm`), which XLA fuses as before."""
    from pallas_kernels.add_rms_norm import add_rms_norm_ref

    if weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm_cpu: weight shape {weight.shape} does not match the "
                         f"hidden size {x.shape[-1]}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"add_rms_norm_cpu: delta shape {delta.shape} != x shape {x.shape}")
    if (x.dtype != jnp.float32 or (delta is not None and delta.dtype != jnp.float32)
            or math.prod(x.shape[:-1]) > NATIVE_NORM_MAX_ROWS):
        return add_rms_norm_ref(x, delta, weight, eps)
    return add_rms_norm_native(x, delta, weight, eps)


def add_rms_norm_native(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                        eps: float) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_cpu`'s native call at any row count (float32; shapes checked there)."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    lead, hidden = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, hidden)
    w = weight.astype(jnp.float32)
    out = jax.ShapeDtypeStruct(flat.shape, jnp.float32)
    if delta is None:
        h = jax.ffi.ffi_call(RMS_NORM_TARGET, out)(flat, w, eps=np.float32(eps))
        return x, h.reshape(*lead, hidden)
    r, h = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (out, out))(
        flat, delta.reshape(-1, hidden), w, eps=np.float32(eps))
    return r.reshape(*lead, hidden), h.reshape(*lead, hidden)


# `models.decoder.DecoderLM` passes a step's real token count to matmuls that take it.
packed_matmul_cpu.takes_live_rows = True
packed_matmul_cpu.silu_mul = True  # takes ``silu_mul`` (`models.qlinear.Linear`)


def _logits_rows(name: str, logits: jax.Array) -> int:
    """The row count of float32 ``logits [B, V]`` for the native samplers; raises when the
    library is missing or the logits are not that."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    if logits.dtype != jnp.float32 or logits.ndim != 2:
        raise TypeError(f"{name}: float32 [B, V] logits, got {logits.dtype} {logits.shape}")
    return logits.shape[0]


def greedy_rows_cpu(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of float32 ``logits [B, V]``: the first maximum's index (int32; a NaN counts as
    the maximum) and its raw logprob ``-log(sum(exp(x - max)))``, reading each row from memory
    once (`csrc/greedy_rows_cpu.cc` says why). Tokens equal `pagedjax.sampler.first_argmax`'s;
    logprobs equal the XLA formula's to float rounding."""
    b = _logits_rows("greedy_rows_cpu", logits)
    call = jax.ffi.ffi_call(GREEDY_TARGET, (jax.ShapeDtypeStruct((b,), jnp.int32),
                                            jax.ShapeDtypeStruct((b,), jnp.float32)))
    return call(logits)


def sample_rows_cpu(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array, min_p: jax.Array, keys: jax.Array, greedy_eps: float, *,
                    rows: jax.Array | None = None,
                    prompt_ids: jax.Array | None = None, output_ids: jax.Array | None = None,
                    presence: jax.Array | None = None, frequency: jax.Array | None = None,
                    repetition: jax.Array | None = None, bias_ids: jax.Array | None = None,
                    bias_values: jax.Array | None = None, banned_ids: jax.Array | None = None,
                    bitmask: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per sampled row, with its raw logprob and rank. Row m reads
    ``logits[rows[m]]`` of float32 ``logits [T, V]`` (``rows [B]``, each in ``[0, T)``; absent:
    every row in order), read in place, not gathered. The row is processed as
    `pagedjax.sampler.sample` processes it (penalties over ``prompt_ids`` / ``output_ids``,
    ``bias_ids`` / ``bias_values`` added, ``banned_ids`` set to -inf, tokens whose ``bitmask``
    bit is clear set to -inf; ``[B, W]`` lists with -1 padding, absent = width 0), then its
    first maximum where ``temperature < greedy_eps``, else a draw from the temperature-scaled
    row cut by top-k, top-p and min-p, with Gumbel noise from the row's threefry
    ``keys [B, 2]`` (uint32 key data). `sample`'s tokens, each row paying only for itself
    (`csrc/sample_rows_cpu.cc` says how and where they may differ). Returns the tokens, the
    logprobs and ranks of the unprocessed rows' log-softmax, and those rows' max and
    log-sum-exp (``log_softmax = (x - max) - lse``, float rounding from XLA's)."""
    t = _logits_rows("sample_rows_cpu", logits)
    if rows is None:
        rows = jnp.arange(t, dtype=jnp.int32)
    rows = jnp.asarray(rows, jnp.int32)
    if rows.ndim != 1:
        raise ValueError(f"sample_rows_cpu: rows must be [B], got {rows.shape}")
    b = rows.shape[0]
    if keys.shape != (b, 2):
        raise ValueError(f"sample_rows_cpu: keys must be [{b}, 2] uint32, got {keys.shape}")
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

    def ids(a):
        return jnp.zeros((b, 0), jnp.int32) if a is None else jnp.asarray(a, jnp.int32)

    def per_row(a, default):
        return jnp.full((b,), default, jnp.float32) if a is None else f32(a)

    lists = {"prompt_ids": ids(prompt_ids), "output_ids": ids(output_ids),
             "bias_ids": ids(bias_ids), "banned_ids": ids(banned_ids), "bitmask": ids(bitmask)}
    for name, a in lists.items():
        if a.ndim != 2 or a.shape[0] != b:
            raise ValueError(f"sample_rows_cpu: {name} must be [{b}, W], got {a.shape}")
    values = jnp.zeros(lists["bias_ids"].shape, jnp.float32) if bias_values is None \
        else f32(bias_values)
    if values.shape != lists["bias_ids"].shape:
        raise ValueError(f"sample_rows_cpu: bias_values {values.shape} must match bias_ids "
                         f"{lists['bias_ids'].shape}")
    if lists["bitmask"].shape[1] and lists["bitmask"].shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"sample_rows_cpu: bitmask needs {-(-logits.shape[1] // 32)} words a "
                         f"row, got {lists['bitmask'].shape[1]}")
    out = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
           jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
           jax.ShapeDtypeStruct((b,), jnp.float32))
    call = jax.ffi.ffi_call(SAMPLE_TARGET, out)
    return call(logits, rows, f32(temperature), jnp.asarray(top_k, jnp.int32), f32(top_p),
                jnp.log(f32(min_p)), jnp.asarray(keys, jnp.uint32), lists["prompt_ids"],
                lists["output_ids"], per_row(presence, 0.0), per_row(frequency, 0.0),
                per_row(repetition, 1.0), lists["bias_ids"], values, lists["banned_ids"],
                lists["bitmask"], greedy_eps=np.float32(greedy_eps))


def lm_head_screen_kind() -> str:
    """Which screen `lm_head_screen` builds here: ``int8`` on an AVX512-VNNI host without AMX
    (`vpdpbusd`: twice `vdpbf16ps`' work per instruction from half its bytes; AMX's bfloat16
    tiles outrun both), else ``bf16``. ``PAGEDJAX_LM_HEAD_INT8=0`` keeps ``bf16`` (A/B runs)."""
    if os.environ.get("PAGEDJAX_LM_HEAD_INT8", "1") == "0":
        return "bf16"
    return "int8" if "avx512vnni" in compiled_isa() and not lm_head_amx() else "bf16"


def lm_head_screen(panels, n: int, kind: str = "auto") -> dict | None:
    """What `lm_head_greedy_cpu` reads besides the float32 panels ``[P, K, 64]`` of an LM head
    of ``n`` columns: each column's L2 norm in float64, rounded up to float32 (``norms``), and
    the head in the screen's precision (``kind``: ``auto`` is `lm_head_screen_kind`):

    - ``bf16``: the panels in bfloat16 pairs ``[P, ceil(K / 2), 64, 2]`` (uint16; k even then k
      odd, as `vdpbf16ps` takes them); half the head's bytes again in memory (57 MB for the
      demo model);
    - ``int8``: each column as steps ``q`` in [-127, 127] of ``s_j = max |w_j| / 127``, in panels
      ``[P, ceil(K / 4), 64, 4]`` (four k per lane, as `vpdpbusd` takes them), with ``qcols``
      ``[2, P * 64]`` (``s_j``; ``||w_j - s_j q_j||`` in float64 rounded up) and ``qbias``
      ``[P * 64]`` (``-128 sum_k q_kj``, int32); a quarter of the head's bytes (28 MB).

    None when a weight or norm is not finite (or rounds to an infinite bfloat16): the bound
    behind the screen would not hold, so such a head is not screened. An ``int8`` screen also
    wants column norms up to 1e15 (so a bound's ``||x|| ||w_j||`` stays finite for every
    screened row) and K up to 32768 (int32 sums); else ``auto`` builds ``bf16``."""
    import ml_dtypes

    w = np.asarray(panels)
    if w.dtype != np.float32 or w.ndim != 3 or w.shape[2] != 64:
        raise TypeError(f"lm_head_screen: float32 panels [P, K, 64], got {w.dtype} {w.shape}")
    if kind not in ("auto", "bf16", "int8"):
        raise ValueError(f"lm_head_screen: kind is auto, bf16 or int8, got {kind!r}")
    if not np.isfinite(w).all():
        return None
    p, k, _ = w.shape
    norms = np.zeros(p * 64, np.float64)
    step = 64  # panels at a time: bounded temporaries
    for b in range(0, p, step):
        blk = w[b:b + step].astype(np.float64)
        norms[b * 64:(b + len(blk)) * 64] = np.sqrt(np.einsum("pkc,pkc->pc", blk, blk)).ravel()
    up = _round_up_f32(norms[:n])
    if not np.isfinite(up).all():
        return None
    if kind == "auto":
        kind = lm_head_screen_kind()
        if kind == "int8" and (up.max(initial=0.0) > 1e15 or k > 32768):
            kind = "bf16"
    if kind == "int8":
        return {"int8": _int8_panels(w, step), "norms": up, **_int8_columns(w, step)}
    kp2 = (k + 1) // 2
    pairs = np.zeros((p, kp2, 64, 2), np.uint16)
    for b in range(0, p, step):
        blk = w[b:b + step]
        bf = blk.astype(ml_dtypes.bfloat16)
        if not np.isfinite(bf.astype(np.float32)).all():
            return None
        if k % 2:
            bf = np.concatenate([bf, np.zeros((len(blk), 1, 64), bf.dtype)], axis=1)
        pairs[b:b + step] = bf.view(np.uint16).reshape(len(blk), kp2, 2, 64).transpose(0, 1, 3, 2)
    return {"bf16": pairs, "norms": up}


def _round_up_f32(v: np.ndarray) -> np.ndarray:
    """float64 values as the nearest float32 at or above each."""
    f = v.astype(np.float32)
    return np.where(f.astype(np.float64) < v, np.nextafter(f, np.float32(np.inf)), f)


def _int8_steps(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Panels ``[p, K, 64]`` as (the columns' steps ``[p, 64]`` float32, codes int8)."""
    s = np.abs(blk).max(axis=1) / np.float32(127)
    safe = np.where(s > 0, s, np.float32(1))[:, None, :]
    q = np.clip(np.rint(blk / safe), -127, 127).astype(np.int8)
    return s.astype(np.float32), q


def _int8_panels(w: np.ndarray, step: int) -> np.ndarray:
    p, k, _ = w.shape
    kq = (k + 3) // 4
    out = np.zeros((p, kq, 64, 4), np.int8)
    for b in range(0, p, step):
        q = _int8_steps(w[b:b + step])[1]
        q = np.concatenate([q, np.zeros((len(q), 4 * kq - k, 64), np.int8)], axis=1)
        out[b:b + step] = q.reshape(len(q), kq, 4, 64).transpose(0, 1, 3, 2)
    return out


def _int8_columns(w: np.ndarray, step: int) -> dict:
    p = w.shape[0]
    cols = np.zeros((2, p * 64), np.float64)
    bias = np.zeros(p * 64, np.int32)
    for b in range(0, p, step):
        blk = w[b:b + step]
        s, q = _int8_steps(blk)
        err = blk.astype(np.float64) - s.astype(np.float64)[:, None, :] * q
        sl = slice(b * 64, (b + len(blk)) * 64)
        cols[0, sl] = s.ravel()
        cols[1, sl] = np.sqrt(np.einsum("pkc,pkc->pc", err, err)).ravel()
        bias[sl] = (-128 * q.astype(np.int32).sum(axis=1)).ravel()
    return {"qcols": np.stack([cols[0].astype(np.float32), _round_up_f32(cols[1])]),
            "qbias": bias}


def lm_head_greedy_cpu(x: jax.Array, screen: dict, panels: jax.Array) -> jax.Array:
    """Per row of float32 hidden states ``x [M, K]``: the first argmax (int32) of the logits
    ``x @ w`` that `dense_matmul_cpu` gives for the LM head's float32 ``panels``, without
    computing them all: screened in bfloat16 or 8 bits with a proven bound, candidates
    recomputed in float32 (`csrc/lm_head_greedy_cpu.cc` says how). ``screen``:
    `lm_head_screen`'s, either kind."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    if x.dtype != jnp.float32 or x.ndim != 2:
        raise TypeError(f"lm_head_greedy_cpu: float32 [M, K] hidden states, got {x.dtype} "
                        f"{x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    if "int8" in screen:
        return jax.ffi.ffi_call(LM_HEAD_GREEDY_INT8_TARGET, out)(
            x, screen["int8"], screen["norms"], screen["qcols"], screen["qbias"], panels)
    return jax.ffi.ffi_call(LM_HEAD_GREEDY_TARGET, out)(x, screen["bf16"], screen["norms"], panels)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype, device: jax.Device | None = None
                        ) -> jax.Array:
    """Zeros in a buffer XLA allocates on the CPU ``device`` (default: the first), advised
    for 2 MiB pages before its pages are touched (`csrc/zeros_huge_pages_cpu.cc` says why):
    for the KV cache, which the step donates and XLA then keeps in place."""
    if not _register():
        raise NativeBuildError("native CPU kernels are not available")
    return _zero_fill(tuple(shape), jnp.dtype(dtype), device or jax.devices("cpu")[0])()


@functools.cache
def _zero_fill(shape: tuple[int, ...], dtype, device: jax.Device):
    """One compiled zero fill per (shape, dtype, device): the K and V caches share it."""
    call = jax.ffi.ffi_call(ZEROS_TARGET, jax.ShapeDtypeStruct(shape, dtype))
    return jax.jit(call, out_shardings=jax.sharding.SingleDeviceSharding(device))
