"""Quantized KV caches: int8 and FP8 (e4m3, e5m2) storage with static scales.

A quantized cache holds ``round(x / s)`` (int8, saturated at ±127) or ``x / s`` rounded to
FP8 (saturated at the format's largest finite value), and every reader multiplies back by
``s``. The scales are static (calibrated once, `pagedjax.worker.kv_calibration`), one per
(layer, KV head, channel) for K and for V, passed to the kernels as ``kv_scale [2, Hkv, D]``
float32 (K, then V). A program of every attention kernel handles one KV head of one layer,
so the scales are two ``[D]`` vectors per program: K's multiplies the queries once
(``q . (s * k) = (s * q) . k``) and V's the output (``sum_t p_t (s * v_t) = s * sum_t p_t
v_t``); the inner loops only widen the stored values. Static scales also keep a cached block
valid for any later reader (prefix caching, swap and copy-on-write move the quantized bytes).

Granularity (`EngineConfig.kv_scale_granularity`): ``per_channel``, ``per_head`` (the same
value over a head's channels) or ``per_tensor`` (one per layer); the kernels are the same.
``per_token`` adds a dynamic factor per (token, KV head) on top of the channel scales:
``x ~ stored * s * f_t`` with ``f_t = max_d |x_d / s_d| / qmax`` chosen when the token is
written, so nothing saturates and each token uses the whole 8-bit range (see "Token factors"
below). Why per channel: keys have outlier channels (on the demo model a channel's largest
|K| is a median 0.25 of its head's), so a per-head scale leaves most channels a few int8
steps. Measured on the demo model's K/V (1 347 tokens x 30 layers x 3 heads), int8 relative
error per channel / per head / per tensor: K 0.5 % / 1.6 % / 1.8 %, V 0.8 % / 1.5 % / 1.7 %;
per-token scales (1.1 % / 0.7 %) would need storage per token and a multiply per element.
FP8 e4m3 is at 2.7 % whatever the scaling (its precision is relative), e5m2 at 5.4 %.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# vLLM's names (`kv_cache_dtype`), and "int8".
KV_CACHE_DTYPES = {
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,  # vLLM's "fp8" is e4m3
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


def resolve_kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """The cache's storage dtype: the model's for "auto", else the named one."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be 'auto' or one of {tuple(KV_CACHE_DTYPES)}; "
                         f"got {name!r}")
    return jnp.dtype(KV_CACHE_DTYPES[name])


def is_quantized(dtype) -> bool:
    d = jnp.dtype(dtype)
    return d == jnp.int8 or d in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def qmax(dtype) -> float:
    """The largest stored magnitude."""
    d = jnp.dtype(dtype)
    if d == jnp.int8:
        return 127.0
    return float(jnp.finfo(d).max)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale`` stored as ``dtype`` (saturating). ``scale`` broadcasts against ``x``."""
    y = x.astype(jnp.float32) / scale
    m = qmax(dtype)
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -m, m).astype(jnp.int8)
    return jnp.clip(y, -m, m).astype(dtype)


def dequantize(xq: jax.Array, scale: jax.Array) -> jax.Array:
    return xq.astype(jnp.float32) * scale


GRANULARITIES = ("per_channel", "per_head", "per_tensor")


def scales_from_amax(amax: np.ndarray, dtype, granularity: str = "per_channel",
                     margin: float | None = None) -> np.ndarray:
    """Static scales ``[layers, 2, Hkv, D]`` from calibrated magnitudes (same shape).

    ``granularity`` shares one value over a head's channels (``per_head``) or over a
    layer's heads and channels (``per_tensor``). ``margin`` is the headroom above the
    calibrated maximum for values the calibration did not see (they saturate): 1.2 for int8,
    where headroom costs resolution; 2 for FP8, whose resolution is relative, so headroom
    costs only range it does not use. An all-zero channel (never written) gets scale 1."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"kv_scale_granularity: must be one of {GRANULARITIES}; "
                         f"got {granularity!r}")
    d = jnp.dtype(dtype)
    if margin is None:
        margin = 1.2 if d == jnp.int8 else 2.0
    a = np.asarray(amax, np.float32)
    if granularity == "per_head":
        a = np.broadcast_to(a.max(axis=-1, keepdims=True), a.shape)
    elif granularity == "per_tensor":
        a = np.broadcast_to(a.max(axis=(-2, -1), keepdims=True), a.shape)
    s = a * np.float32(margin) / np.float32(qmax(d))
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)


def check_kv_scale(k_cache: jax.Array, kv_scale: jax.Array | None) -> jax.Array | None:
    """The kernels' ``kv_scale`` argument: ``[2, Hkv, D]`` float32 for a quantized cache (an
    error naming it when missing or misshapen), None for a float cache (nothing to scale)."""
    if not is_quantized(k_cache.dtype):
        return None
    want = (2, k_cache.shape[-4], k_cache.shape[-1])
    if kv_scale is None or tuple(kv_scale.shape) != want:
        got = None if kv_scale is None else tuple(kv_scale.shape)
        raise ValueError(f"kv_scale: a {jnp.dtype(k_cache.dtype).name} cache needs static "
                         f"scales of shape {want}; got {got}")
    return jnp.asarray(kv_scale, jnp.float32)


# ---- Token factors (granularity "per_token") -------------------------------------------
# A token's float32 factor lives in the cache itself, in extra slots after the data slots:
# ``cache[data_slots + slot // (D // 4), head, block, offset, 4 * (slot % (D // 4)) :][:4]``
# holds the factor of (cache slot `slot`, `head`, `block`, `offset`) as 4 bytes. A block
# therefore carries its tokens' factors: swap, copy-on-write and prefix sharing move them
# with the values and need no change, and no reader can see a factor of another block.
# Cost: 4 bytes per token and head per slot (6 % more than the values at head dim 64).
# Readers: the key's factor multiplies its logit, the value's its softmax weight.
# int8 caches only (`PER_TOKEN_DTYPE`).

FACTOR_BYTES = 4


def factor_slots(num_slots: int, head_dim: int) -> int:
    """Extra cache slots holding the token factors of ``num_slots`` data slots."""
    if head_dim % FACTOR_BYTES:
        raise ValueError(f"kv_scale_granularity 'per_token': head_dim {head_dim} is not a "
                         f"multiple of {FACTOR_BYTES}")
    return -(-num_slots // (head_dim // FACTOR_BYTES))


def data_slots(total_slots: int, head_dim: int) -> int:
    """The data slots of a cache with ``total_slots`` slots, factor slots included (the
    inverse of ``n + factor_slots(n, head_dim)``, which grows strictly with n)."""
    n = total_slots * (head_dim // FACTOR_BYTES) // (head_dim // FACTOR_BYTES + 1)
    while n + factor_slots(n, head_dim) < total_slots:
        n += 1
    while n > 0 and n + factor_slots(n, head_dim) > total_slots:
        n -= 1
    if n + factor_slots(n, head_dim) != total_slots:
        raise ValueError(f"a per-token cache cannot have {total_slots} slots at head_dim "
                         f"{head_dim}")
    return n


def quantize_per_token(x: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x [T, H, D]`` stored as ``dtype`` with channel scales ``scale [H, D]`` and a factor
    per (token, head): returns (stored ``[T, H, D]``, factors ``[T, H]`` float32). An
    all-zero vector gets factor 1."""
    y = x.astype(jnp.float32) / scale
    f = jnp.max(jnp.abs(y), axis=-1) / qmax(dtype)
    f = jnp.where(f > 0, f, 1.0)
    return quantize(y, f[..., None], dtype), f


def factors_as_bytes(f: jax.Array, dtype) -> jax.Array:
    """Float32 factors ``[...]`` as ``[..., 4]`` of the cache's 1-byte dtype."""
    return jax.lax.bitcast_convert_type(f.astype(jnp.float32), jnp.dtype(dtype))


def read_factors(cache5: jax.Array, slot: jax.Array | int) -> jax.Array:
    """Token factors of one data slot of a 5-D per-token cache: ``[Hkv, num_blocks,
    block_size]`` float32 (gathered through block tables like the values)."""
    total, _, _, _, d = cache5.shape
    per = d // FACTOR_BYTES
    n = data_slots(total, d)
    slot = jnp.asarray(slot, jnp.int32)
    ext = jax.lax.dynamic_index_in_dim(cache5, n + slot // per, 0, keepdims=False)
    raw = jax.lax.dynamic_slice_in_dim(ext, FACTOR_BYTES * (slot % per), FACTOR_BYTES, axis=-1)
    return jax.lax.bitcast_convert_type(raw, jnp.float32)


def write_factors(cache5: jax.Array, slot: jax.Array | int, block: jax.Array,
                  offset: jax.Array, f: jax.Array) -> jax.Array:
    """``cache5`` with factors ``f [T, Hkv]`` written for tokens at (``block``, ``offset``)
    ``[T]`` of data slot ``slot`` (out-of-range blocks are dropped, as padding)."""
    total, hkv, _, _, d = cache5.shape
    per = d // FACTOR_BYTES
    n = data_slots(total, d)
    slot = jnp.asarray(slot, jnp.int32)
    raw = factors_as_bytes(f, cache5.dtype)  # [T, Hkv, 4]
    col = FACTOR_BYTES * (slot % per) + jnp.arange(FACTOR_BYTES, dtype=jnp.int32)
    t = f.shape[0]
    idx = (jnp.broadcast_to(n + slot // per, (t, hkv, FACTOR_BYTES)),
           jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[None, :, None],
                            (t, hkv, FACTOR_BYTES)),
           jnp.broadcast_to(block[:, None, None], (t, hkv, FACTOR_BYTES)),
           jnp.broadcast_to(offset[:, None, None], (t, hkv, FACTOR_BYTES)),
           jnp.broadcast_to(col[None, None, :], (t, hkv, FACTOR_BYTES)))
    return cache5.at[idx].set(raw, mode="drop")


def check_token_scales(k_cache: jax.Array, token_scales: bool, backend: str) -> bool:
    """The kernels' ``token_scales`` flag, checked: an int8 cache with factor slots, read by
    the CPU or XLA backend (the Pallas GPU kernels do not read factors yet)."""
    if not token_scales:
        return False
    if jnp.dtype(k_cache.dtype) != jnp.int8:
        raise ValueError(PER_TOKEN_DTYPE + f"; got {jnp.dtype(k_cache.dtype).name}")
    if backend == "pallas":
        raise ValueError(PER_TOKEN_BACKENDS)
    if k_cache.ndim != 5:
        raise ValueError("token_scales: the cache must be 5-D [slots, Hkv, blocks, bs, D]")
    data_slots(k_cache.shape[0], k_cache.shape[-1])  # raises on a slot count without factors
    return True


# int8 only: an FP8 cache would hold the factors' bytes as FP8 values, and XLA may rewrite
# NaN encodings of float arrays it moves (e5m2 has several), corrupting a factor; and FP8's
# loss is K's 3-bit mantissa, which a factor does not fix (bench/kv_quant_schemes.py: e4m3
# 4.55 % per channel, 3.20 % with factors).
PER_TOKEN_DTYPE = "kv_scale_granularity 'per_token' needs kv_cache_dtype 'int8'"
PER_TOKEN_BACKENDS = ("kv_scale_granularity 'per_token': the Pallas GPU kernels do not read "
                      "per-token factors yet; use the 'cpu' or 'xla' attention backend, or "
                      "'per_channel' scales")
