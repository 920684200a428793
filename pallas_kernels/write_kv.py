"""Scatter new tokens' K/V into the paged cache, in place.

The Pallas kernel runs one program per token and writes each KV head's ``head_dim`` row at
``slot = physical_block * block_size + offset``. The caches are passed through
``input_output_aliases``, so under a jit that donates them XLA updates the buffer in place
instead of copying a cache that is most of device memory. Negative slots are padding and
are skipped (as are slots past the end of the cache). A quantized cache (`kv_quant`) gets the
tokens quantized with the layer's static ``kv_scale`` first; the kernel moves the stored bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import cpu_native
from pallas_kernels._common import as_5d, from_5d, layer_arg
from pallas_kernels.backend import interpret_mode, resolve_backend, triton_params, uses_pallas
from pallas_kernels.kv_quant import (
    check_kv_scale,
    check_token_scales,
    is_quantized,
    quantize,
    quantize_per_token,
    write_factors,
)


def _write_kernel(
    layer_ref,  # [1]
    slots_ref,  # [N]
    kv_ref,  # [2, N, Hkv, D]: K and V stacked (`_write_kv_pallas` says why)
    k_cache_in,  # aliased with k_cache_ref
    v_cache_in,
    k_cache_ref,  # [L * Hkv * NB * bs, D]
    v_cache_ref,
    *,
    num_kv_heads: int,
    slots_per_head: int,
):
    del k_cache_in, v_cache_in
    token = pl.program_id(0)
    slot = slots_ref[token]

    @pl.when((slot >= 0) & (slot < slots_per_head))
    def _():
        for head in range(num_kv_heads):
            row = (layer_ref[0] * num_kv_heads + head) * slots_per_head + slot
            k_cache_ref[row, :] = kv_ref[0, token, head, :]
            v_cache_ref[row, :] = kv_ref[1, token, head, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_kv_pallas(k, v, k_cache, v_cache, slot_mapping, layer, *, interpret: bool):
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    flat = (num_layers * num_kv_heads * num_blocks * block_size, head_dim)
    kernel = functools.partial(
        _write_kernel, num_kv_heads=num_kv_heads, slots_per_head=num_blocks * block_size
    )
    whole = pl.no_block_spec
    k_out, v_out = pl.pallas_call(
        kernel,
        grid=(k.shape[0],),
        in_specs=[whole] * 5,
        out_specs=[whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct(flat, k5.dtype),
            jax.ShapeDtypeStruct(flat, v5.dtype),
        ],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=triton_params(num_warps=1, num_stages=1),
        name="write_kv",
    )(
        layer.reshape(1),
        slot_mapping.astype(jnp.int32),
        # One operand for both: XLA then computes K (its rotary) and V (a slice of the
        # fused qkv projection) in one fusion, where two operands took two launches.
        jnp.stack([k.astype(k5.dtype), v.astype(v5.dtype)]),
        k5.reshape(flat),
        v5.reshape(flat),
    )
    return (
        from_5d(k_out.reshape(k5.shape), k_cache.ndim),
        from_5d(v_out.reshape(v5.shape), v_cache.ndim),
    )


@jax.jit
def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, layer, factors=None):
    """Pure-jnp reference: one scatter per cache; padding slots index out of range and drop.
    ``factors``: K's and V's per-token factors ``[T, Hkv]`` of a per-token cache (`kv_quant`),
    written into its factor slots."""
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_blocks, block_size = k5.shape[2], k5.shape[3]
    slots = slot_mapping.astype(jnp.int32)
    # Negative indices would wrap around, so send padding past the end where "drop" skips it.
    block = jnp.where(slots >= 0, slots // block_size, num_blocks)
    offset = jnp.where(slots >= 0, slots % block_size, 0)
    # Advanced indices separated by a slice put the token axis first: [N, Hkv, D] == k.
    k5 = k5.at[layer, :, block, offset].set(k.astype(k5.dtype), mode="drop")
    v5 = v5.at[layer, :, block, offset].set(v.astype(v5.dtype), mode="drop")
    if factors is not None:
        k5 = write_factors(k5, layer, block, offset, factors[0])
        v5 = write_factors(v5, layer, block, offset, factors[1])
    return from_5d(k5, k_cache.ndim), from_5d(v5, v_cache.ndim)


def write_kv(
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    backend: str | None = None,
    kv_scale: jax.Array | None = None,
    token_scales: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write ``k``/``v`` ``[num_tokens, Hkv, head_dim]`` into cache slots ``slot_mapping``.

    Returns the updated ``(k_cache, v_cache)``; donate the caches in the enclosing jit to
    make the update in place. ``slot_mapping`` entries < 0 are padding and are skipped.
    ``kv_scale [2, Hkv, D]``: this layer's static scales, required by a quantized cache (int8 /
    FP8, `pallas_kernels.kv_quant`), which stores ``k / kv_scale[0]`` and ``v / kv_scale[1]``.
    ``token_scales``: the cache has factor slots (granularity "per_token"): each token is
    stored over its own factor, written beside it (CPU and XLA backends).
    """
    if token_scales:
        return _write_per_token(k, v, k_cache, v_cache, slot_mapping, layer, backend, kv_scale)
    lay = layer_arg(k_cache, layer)
    if is_quantized(k_cache.dtype):
        sc = check_kv_scale(k_cache, kv_scale)
        k = quantize(k, sc[0][None], k_cache.dtype)
        v = quantize(v, sc[1][None], v_cache.dtype)
        if (jnp.dtype(k_cache.dtype).name.startswith("float8")
                and resolve_backend(backend) == "cpu"):
            # XLA:CPU scatters float8 by widening the whole cache (~50 ms a call on the demo
            # model): the native kernel copies the bytes in place instead.
            k5, v5 = cpu_native.write_kv_bytes_cpu(k, v, as_5d(k_cache), as_5d(v_cache),
                                                   slot_mapping, lay)
            return from_5d(k5, k_cache.ndim), from_5d(v5, v_cache.ndim)
    if not uses_pallas(backend):
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping, lay)
    return _write_kv_pallas(k, v, k_cache, v_cache, slot_mapping, lay, interpret=interpret_mode())


def _write_per_token(k, v, k_cache, v_cache, slot_mapping, layer, backend, kv_scale):
    """`write_kv` into a per-token cache: quantize over each token's factor, then write the
    bytes and the factors (the native byte scatter on CPU, XLA's scatter otherwise)."""
    chosen = resolve_backend(backend)
    check_token_scales(k_cache, True, chosen)
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    sc = check_kv_scale(k_cache, kv_scale)
    lay = layer_arg(k_cache, layer)
    kq, kf = quantize_per_token(k, sc[0][None], k_cache.dtype)
    vq, vf = quantize_per_token(v, sc[1][None], v_cache.dtype)
    if chosen == "cpu":
        k5, v5 = cpu_native.write_kv_bytes_cpu(kq, vq, k5, v5, slot_mapping, lay, (kf, vf))
        return from_5d(k5, k_cache.ndim), from_5d(v5, v_cache.ndim)
    return write_kv_ref(kq, vq, k_cache, v_cache, slot_mapping, lay, (kf, vf))

