"""Quantized KV caches: int8 and FP8 (e4m3, e5m2) storage with static scales.

A quantized cache holds ``round(x / s)`` (int8, saturated at ±127) or ``x / s`` rounded to
FP8 (saturated at the format's largest finite value), and every reader multiplies back by
``s``. The scales are static, one per (layer, KV head) for K and for V, passed to the
kernels as ``kv_scale [2, Hkv]`` float32 (row 0: K, row 1: V). Because a program of every
attention kernel handles one KV head of one layer, the scales are two scalars per program:
K's folds into the softmax scale (``q . (s k) = s (q . k)``) and V's multiplies the output
(``sum_t p_t s v_t = s sum_t p_t v_t``), so the inner loops only widen the stored values.
Static scales also keep a cached block valid for any later reader (prefix caching, swap,
copy-on-write move the quantized bytes as they are).

Why static per-(layer, KV head) rather than per-token scales: measured on the demo model's
K/V (1 347 tokens x 30 layers x 3 heads), int8 with per-head scales has a relative error of
1.6 % (K) and 1.5 % (V) against 1.1 % / 0.7 % per token, at no per-token storage and no
per-element multiply in the kernels; FP8 e4m3 is at 2.7 % whatever the scaling (its
precision is relative), e5m2 at 5.4 %. Per-tensor scales (one per layer) are the option
``per_tensor``: 1.8 % / 1.7 % for int8.
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


def scales_from_amax(amax: np.ndarray, dtype, per_tensor: bool = False,
                     margin: float | None = None) -> np.ndarray:
    """Static scales ``[layers, 2, Hkv]`` from calibrated magnitudes ``amax [layers, 2, Hkv]``.

    ``margin`` is the headroom above the calibrated maximum for values the calibration did
    not see (they saturate): 1.2 for int8, where headroom costs resolution; 2 for FP8, whose
    resolution is relative, so headroom costs only range it does not use. An all-zero head
    (never written) gets scale 1."""
    d = jnp.dtype(dtype)
    if margin is None:
        margin = 1.2 if d == jnp.int8 else 2.0
    a = np.asarray(amax, np.float32)
    if per_tensor:
        a = np.broadcast_to(a.max(axis=-1, keepdims=True), a.shape)
    s = a * np.float32(margin) / np.float32(qmax(d))
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)


def check_kv_scale(k_cache: jax.Array, kv_scale: jax.Array | None) -> jax.Array | None:
    """The kernels' ``kv_scale`` argument: ``[2, Hkv]`` float32 for a quantized cache (an
    error naming it when missing or misshapen), None for a float cache (nothing to scale)."""
    if not is_quantized(k_cache.dtype):
        return None
    hkv = k_cache.shape[-4]
    if kv_scale is None or tuple(kv_scale.shape) != (2, hkv):
        got = None if kv_scale is None else tuple(kv_scale.shape)
        raise ValueError(f"kv_scale: a {jnp.dtype(k_cache.dtype).name} cache needs static "
                         f"scales of shape (2, {hkv}); got {got}")
    return jnp.asarray(kv_scale, jnp.float32)
