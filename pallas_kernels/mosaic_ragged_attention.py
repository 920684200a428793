"""Ragged paged attention for Hopper in Mosaic GPU: prefill chunks, whole prompts and decode
rows of many sequences in one launch, with the contract of
:func:`pallas_kernels.ragged_paged_attention` (its reference is the test's oracle).

The flat query batch is cut into work items of at most ``64 / G`` tokens of one sequence
(`ragged_paged_attention.work_items`; ``G`` = the GQA group padded to a power of two), so an
item's queries times its group fill wgmma's 64 rows (row ``r`` is token ``r // G``, head
``r % G``). One warpgroup per (item, KV head) walks the item's keys, ``[0, last position]``,
through the chunk loop the decode kernel uses (`mosaic_decode_attention.attend_chunks`: TMA
page gathers into a two-slot SMEM ring, wgmma, base-2 online softmax), with the causal mask
by position: row ``r`` sees keys ``<= pos0 + r // G`` (and, windowed, the last ``window`` of
them; chunks wholly before the item's first window are not read). Rows past the item's tokens or the
group are computed on zeros and dropped. The mask value is finite so a fully masked row
stays finite (and is dropped), never NaN.

The items' queries are gathered into ``[items, Hkv, 64, D]`` tiles and the outputs scattered
back by XLA around the kernel: a copy of the step's queries and outputs, small beside the
KV traffic. Quantized caches, soft-capping and head dim 256 (two column programs per item
and head, folded into the head axis) as the decode kernel. Scope as the decode kernel
(`supports`), less head dim 128 with 128-token pages (it spills: `shape_ok`); Triton serves
the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import MASK_VALUE, as_5d, cdiv, next_pow2, own_buffer, window_span
from pallas_kernels.mosaic_decode_attention import (
    ROWS,
    attend_chunks,
    barriers,
    chunk_tokens,
    col_parts,
    page_copier,
    scale_channels,
    scratch_types,
    split_scratch,
    store_tile,
)


def _kernel(scalars_ref, items_ref, tables_ref, q_ref, k_ref, v_ref,  # inputs (GMEM)
            out_ref,  # output (GMEM)
            q_smem, k_smem, v_smem, p_smem, o_smem, *scratch,  # (+ stage), barriers
            num_kv_heads: int, num_blocks: int, block_size: int, group_p: int, scale: float,
            softcap: float | None, windowed: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    stage, (q_bar, k_bar, v_bar) = split_scratch(q_smem, k_smem, scratch)
    item, program = lax.axis_index("item"), lax.axis_index("head")
    parts = k_smem.shape[-1] // v_smem.shape[-1]  # column programs per head (head dim 256)
    head, part = lax.div(program, jnp.int32(parts)), lax.rem(program, jnp.int32(parts))
    chunk = k_smem.shape[1]
    seq, n_rows, pos0 = items_ref[0, item], items_ref[2, item], items_ref[3, item]
    kv_end = pos0 + n_rows  # keys [kv_lo, kv_end): what the item's queries see together
    span = scalars_ref[1]
    kv_lo = jnp.maximum(pos0 - span + 1, 0) if windowed else jnp.int32(0)
    first = lax.div(kv_lo, jnp.int32(chunk))
    n = jnp.where(n_rows > 0, lax.div(kv_end + chunk - 1, jnp.int32(chunk)) - first, 0)
    used_pages = lax.div(kv_end + block_size - 1, jnp.int32(block_size))
    base = (scalars_ref[0] * num_kv_heads + head) * num_blocks
    issue = page_copier(tables_ref, seq, first, used_pages, base, num_blocks, block_size,
                        k_ref, v_ref, k_smem, v_smem, k_bar, v_bar,
                        v_col0=part * v_smem.shape[-1])

    def visible(key):
        row_pos = pos0 + lax.div(plgpu.broadcasted_iota(jnp.int32, key.shape, 0,
                                                        layout=plgpu.Layout.WGMMA),
                                 jnp.int32(group_p))
        seen = (key <= row_pos) & (key < kv_end)
        return seen & (key > row_pos - span) if windowed else seen

    acc, _, l_i = attend_chunks(n, first, issue, q_ref.at[item, head], q_bar, visible, kv_lo,
                                kv_end, q_smem, k_smem, v_smem, p_smem, k_bar, v_bar,
                                scale=scale, softcap=softcap, m_init=MASK_VALUE, stage=stage)
    l_safe = jnp.where(l_i > 0, l_i, 1.0)
    store_tile(acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), o_smem,
               out_ref.at[item, program])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "windowed", "interpret"))
def mosaic_ragged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                            kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array,
                            num_seqs: jax.Array, layer: jax.Array, window: jax.Array | int = 0,
                            kv_scale: jax.Array | None = None, *, scale: float,
                            softcap: float | None = None, windowed: bool = False,
                            interpret: bool = False) -> jax.Array:
    """``ragged_paged_attention`` in Mosaic GPU; rows past ``cu_q_lens[num_seqs]`` are zero.
    ``window`` is data, read when ``windowed``; ``kv_scale [2, Hkv, D]``: an int8 / FP8
    cache's scales (K's on the query tiles before the kernel, V's on its output after);
    ``interpret``: the GPU interpreter."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.ragged_paged_attention import live_q_lens, work_items

    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, hkv, num_blocks, block_size, d = k5.shape
    num_tokens, hq, _ = q.shape
    group = hq // hkv
    group_p = next_pow2(group)
    tokens_per_item = ROWS // group_p
    chunk = chunk_tokens(block_size)
    items = work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, tokens_per_item)
    q_start, n_rows = items[1], items[2]
    num_items = items.shape[1]

    # Gather each item's queries into its 64 rows (row r: token r // G, head r % G).
    r = jnp.arange(ROWS, dtype=jnp.int32)
    tok, g = r // group_p, r % group_p
    rows_ok = (tok[None, :] < n_rows[:, None]) & (g < group)[None, :]  # [I, ROWS]
    tok_idx = jnp.clip(q_start[:, None] + tok[None, :], 0, num_tokens - 1)
    head_idx = jnp.arange(hkv, dtype=jnp.int32)[:, None] * group + jnp.minimum(g, group - 1)
    qt = q[tok_idx[:, None, :], head_idx[None, :, :]]  # [I, Hkv, ROWS, D]
    qt = jnp.where(rows_ok[:, None, :, None], qt, jnp.zeros((), q.dtype))
    if kv_scale is not None:
        qt = scale_channels(qt, kv_scale[0]).astype(q.dtype)

    # Every page index a chunk of the longest item can form.
    pages = max(block_tables.shape[1], cdiv(cdiv(block_tables.shape[1] * block_size, chunk)
                                            * chunk, block_size))
    # A buffer of its own (`own_buffer`: Mosaic needs aligned inputs; the runner's are views).
    tables = own_buffer(block_tables.astype(jnp.int32), max(1, pages - block_tables.shape[1]))
    flat = (num_layers * hkv * num_blocks, block_size, d)
    parts = col_parts(d)
    dv = d // parts
    kernel = functools.partial(_kernel, num_kv_heads=hkv, num_blocks=num_blocks,
                               block_size=block_size, group_p=group_p, scale=float(scale),
                               softcap=softcap, windowed=windowed)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_items, hkv * parts, ROWS, dv), jnp.float32),
        scratch_types=(*scratch_types(d, chunk, q.dtype, stats=False, cache_dtype=k5.dtype),
                       *barriers(chunk // block_size)),
        grid=(num_items, hkv * parts), grid_names=("item", "head"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(jnp.stack([jnp.reshape(layer, ()), window_span(window)]).astype(jnp.int32), items, tables,
      qt, k5.reshape(flat), v5.reshape(flat))
    out = jnp.moveaxis(out.reshape(num_items, hkv, parts, ROWS, dv), 2, -2).reshape(
        num_items, hkv, ROWS, d)
    if kv_scale is not None:
        out = scale_channels(out, kv_scale[1])

    # Scatter back: token t of sequence s is row (t - cu[s]) % T_item of item starts[s] + ...
    max_seqs = kv_lens.shape[0]
    cu, q_lens = live_q_lens(cu_q_lens, num_seqs, max_seqs)
    blocks = (q_lens + tokens_per_item - 1) // tokens_per_item
    starts = jnp.cumsum(blocks) - blocks
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(cu[1:max_seqs + 1], t, side="right"), 0, max_seqs - 1)
    j = t - cu[tseq]
    item_of = jnp.clip(starts[tseq] + j // tokens_per_item, 0, num_items - 1)
    row0 = (j % tokens_per_item) * group_p
    heads = jnp.arange(hq, dtype=jnp.int32)
    res = out[item_of[:, None], (heads // group)[None, :],
              row0[:, None] + (heads % group)[None, :]]  # [T, Hq, D]
    live = t < jnp.sum(q_lens)
    return jnp.where(live[:, None, None], res, 0.0).astype(q.dtype)
