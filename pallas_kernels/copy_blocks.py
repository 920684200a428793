"""Copy whole cache blocks (copy-on-write after a fork), every layer and head in one launch.

The grid is ``(layer * kv_head, pair, tile)``: each program copies one contiguous row tile
of a ``[block_size, head_dim]`` block of K and of V (a whole small block, or a slice of a
large one, so no program holds more than a few KiB in registers). The caches are aliased
input->output so a donating caller updates them in place. Pairs with a negative source (or destination) are
padding. Destinations must be distinct and must not be sources of other pairs in the same
call (true for copy-on-write, whose destinations are freshly allocated blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import as_5d, from_5d
from pallas_kernels.backend import interpret_mode, triton_params, uses_pallas

# Elements per program: a whole 256-token fp32 page at head_dim 256 is 256 KiB, far more
# than one program's registers (the H100 compile tier saw 7 KiB of spills), so a block is
# copied as several row tiles of at most this many elements, one program each.
_TILE_ELEMS = 4096


def _copy_kernel(map_ref, k_in, v_in, k_out, v_out, *, num_blocks: int, tile_rows: int):
    # Read the sources through the output refs: they alias the inputs, and touching only
    # one view lets the interpreter (and XLA) keep a single buffer instead of copying.
    del k_in, v_in
    layer_head, pair, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    src = map_ref[pair, 0]
    dst = map_ref[pair, 1]
    rows = pl.ds(tile * tile_rows, tile_rows)

    @pl.when((src >= 0) & (dst >= 0) & (src < num_blocks) & (dst < num_blocks))
    def _():
        base = layer_head * num_blocks
        k_out[base + dst, rows, :] = k_out[base + src, rows, :]
        v_out[base + dst, rows, :] = v_out[base + src, rows, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _copy_blocks_pallas(k_cache, v_cache, block_mapping, *, interpret: bool):
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    flat = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return k_cache, v_cache
    tile_rows = max(1, min(block_size, _TILE_ELEMS // head_dim))
    whole = pl.no_block_spec
    k_out, v_out = pl.pallas_call(
        functools.partial(_copy_kernel, num_blocks=num_blocks, tile_rows=tile_rows),
        grid=(num_layers * num_kv_heads, num_pairs, block_size // tile_rows),
        in_specs=[whole] * 3,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(flat, k5.dtype), jax.ShapeDtypeStruct(flat, v5.dtype)],
        input_output_aliases={1: 0, 2: 1},
        interpret=interpret,
        compiler_params=triton_params(num_warps=4, num_stages=1),
        name="copy_blocks",
    )(block_mapping.astype(jnp.int32), k5.reshape(flat), v5.reshape(flat))
    return (
        from_5d(k_out.reshape(k5.shape), k_cache.ndim),
        from_5d(v_out.reshape(v5.shape), v_cache.ndim),
    )


@jax.jit
def copy_blocks_ref(k_cache, v_cache, block_mapping):
    """Pure-jnp reference: gather the sources, scatter to destinations (padding dropped)."""
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_blocks = k5.shape[2]
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    ok = (src >= 0) & (dst >= 0) & (src < num_blocks) & (dst < num_blocks)
    src = jnp.where(ok, src, 0)
    dst = jnp.where(ok, dst, num_blocks)
    k5 = k5.at[:, :, dst].set(k5[:, :, src], mode="drop")
    v5 = v5.at[:, :, dst].set(v5[:, :, src], mode="drop")
    return from_5d(k5, k_cache.ndim), from_5d(v5, v_cache.ndim)


def copy_blocks(
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_mapping: jax.Array,
    *,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Copy block ``src -> dst`` for each row of ``block_mapping [num_pairs, 2]``.

    Applies to every layer and KV head of both caches; donate the caches for in-place.
    """
    if not uses_pallas(backend):
        return copy_blocks_ref(k_cache, v_cache, block_mapping)
    return _copy_blocks_pallas(k_cache, v_cache, block_mapping, interpret=interpret_mode())
