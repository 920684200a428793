"""Shared helpers: cache-rank normalisation, layer indices, padding sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity" for masked logits: exp(MASK - m) underflows to exactly 0 while
# fully masked rows still stay finite (a true -inf would give inf - inf = NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def own_buffer(x: jax.Array, pad: int = 1) -> jax.Array:
    """``x`` with ``pad`` (>= 1) zeros appended on its last axis: an op XLA keeps, so the
    result has an allocation of its own. Why: Mosaic GPU's custom call rejects an operand that
    is not 256-byte aligned, and XLA may hand a custom call a view into a larger buffer instead
    (the runner slices a step's block tables and lengths out of one packed int array; on the
    H200 the whole-model step failed with "Input buffer 2 is not 256-byte aligned"). XLA's own
    allocations are aligned."""
    if pad < 1:
        raise ValueError(f"own_buffer: pad must be >= 1, got {pad}")
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_arg(cache: jax.Array, layer: int | jax.Array | None) -> jax.Array:
    """Validate ``layer`` against the cache rank; return it as an int32 scalar array.

    Passing the layer as data (never as a static argument) means one compilation serves
    every layer and the model can call the kernels inside ``lax.scan`` over layers.
    """
    if cache.ndim not in (4, 5):
        raise ValueError(f"cache must be 4-D or 5-D, got shape {cache.shape}")
    if isinstance(layer, int | np.integer):
        limit = 1 if cache.ndim == 4 else cache.shape[0]
        if not 0 <= int(layer) < limit:
            raise ValueError(f"layer={layer} out of range for cache of shape {cache.shape}")
    elif layer is None and cache.ndim == 5 and cache.shape[0] != 1:
        raise ValueError("layer is required for a multi-layer cache")
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())


def as_5d(cache: jax.Array) -> jax.Array:
    """View a single-layer 4-D cache as ``[1, Hkv, NB, bs, D]`` (a free reshape)."""
    return cache[None] if cache.ndim == 4 else cache


def from_5d(cache5: jax.Array, ndim: int) -> jax.Array:
    return cache5[0] if ndim == 4 else cache5


# A window this wide is "no window": larger than any context, small enough that position
# arithmetic on it never overflows int32.
NO_WINDOW = 1 << 30


def window_arg(window: int | jax.Array | None) -> jax.Array:
    """Sliding window as an int32 scalar array (0 or None: full attention). Data, not a
    static argument, so windowed and full layers share one compilation."""
    return jnp.asarray(0 if window is None else window, jnp.int32).reshape(())


def window_span(window: jax.Array | int) -> jax.Array:
    """How many positions back a query sees, itself included: the window, or `NO_WINDOW`."""
    w = jnp.asarray(window, jnp.int32)
    return jnp.where(w > 0, w, NO_WINDOW)


def apply_softcap(logits: jax.Array, softcap: float | None) -> jax.Array:
    """Attention logit soft-capping ``c * tanh(logits / c)`` (Gemma 2); None: unchanged."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def has_window(window) -> bool:
    """False when ``window`` is statically absent (None or the Python int 0): the kernels then
    compile without the window's bounds. A traced window (the layer scan) or a positive int
    gets the windowed variant, which also serves full-attention layers (window 0 at run time)."""
    return not (window is None or (isinstance(window, int | np.integer) and int(window) == 0))
