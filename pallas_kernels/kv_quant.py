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

Granularity (`EngineConfig.kv_scale_granularity`): ``per_channel`` (the default), ``per_head``
(the same value over a head's channels) or ``per_tensor`` (one per layer); the kernels are
the same. Why per channel: keys have outlier channels (on the demo model a channel's largest
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
