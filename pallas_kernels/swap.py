"""Swap cache blocks between device memory and a host (numpy) pool.

``swap_out`` gathers the requested blocks of every layer and head on device first, so the
device-to-host transfer is one contiguous copy per cache rather than one per block.
``swap_in`` sends the host blocks over once and scatters them with a donated, in-place
update. Host arrays are ``[num_layers, Hkv, n, block_size, head_dim]`` (4-D caches give
``[Hkv, n, block_size, head_dim]``), ready for ``host_pool[:, :, cpu_ids] = k_host``.

The number of blocks is padded to a power-of-two bucket (at least 8), so a serving engine
compiles one gather and one scatter per bucket rather than one per block count (each compile
stalls every request). Padding ids gather block 0 (rows dropped on the host) and scatter to
an out-of-range block (dropped by the update), so padding never touches the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MIN_BUCKET = 8


def bucket(n: int) -> int:
    """Padded block count for ``n`` blocks: the next power of two, at least 8."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


@jax.jit
def _gather(k_cache, v_cache, block_ids):
    axis = k_cache.ndim - 3
    return jnp.take(k_cache, block_ids, axis=axis), jnp.take(v_cache, block_ids, axis=axis)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _scatter(k_cache, v_cache, k_blocks, v_blocks, block_ids):
    idx = (slice(None),) * (k_cache.ndim - 3) + (block_ids,)
    k_cache = k_cache.at[idx].set(k_blocks.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[idx].set(v_blocks.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def swap_out(
    k_cache: jax.Array, v_cache: jax.Array, block_ids: jax.Array | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Copy blocks ``block_ids`` of both caches to host numpy arrays."""
    n = len(block_ids)
    ids = np.zeros(bucket(n), np.int32)
    ids[:n] = np.asarray(block_ids, np.int32)
    k_blocks, v_blocks = _gather(k_cache, v_cache, ids)
    k_host, v_host = jax.device_get((k_blocks, v_blocks))
    axis = k_cache.ndim - 3
    keep = (slice(None),) * axis + (slice(0, n),)
    return np.asarray(k_host)[keep], np.asarray(v_host)[keep]


def swap_in(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_host: np.ndarray,
    v_host: np.ndarray,
    block_ids: jax.Array | np.ndarray,
) -> tuple[jax.Array, jax.Array]:
    """Write host blocks back into device blocks ``block_ids``; the caches are donated."""
    n = len(block_ids)
    axis = k_cache.ndim - 3
    ids = np.full(bucket(n), k_cache.shape[axis], np.int32)  # past the end: dropped
    ids[:n] = np.asarray(block_ids, np.int32)
    pad = [(0, 0)] * k_host.ndim
    pad[axis] = (0, len(ids) - n)
    k_dev, v_dev = jax.device_put((np.pad(k_host, pad), np.pad(v_host, pad)))
    return _scatter(k_cache, v_cache, k_dev, v_dev, ids)
