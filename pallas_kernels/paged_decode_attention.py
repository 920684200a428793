"""Paged decode attention: one query token per sequence against its paged KV history.

Flash-decoding layout: the grid is ``(seq, kv_head, split)``. Each split walks a contiguous
slice of the sequence's context in chunks of ``chunk_tokens`` tokens (several small pages
gathered through the block table, or a slice of one large page), keeping an
online-softmax state (running max ``m``, denominator ``l``, unnormalised accumulator) in
fp32, and writes that partial state out. A small jnp epilogue merges the splits with a
log-sum-exp combine. Splitting the context is what lets a handful of long sequences still
occupy every SM; with many sequences one split is enough.

All query heads that share a KV head are processed together (GQA), so each K/V tile is read
once per group. The group is padded to a power of two >= 16 because Triton's ``dot`` needs
that; the padded rows are dropped in the epilogue.

Masking is by length: K/V come in through masked loads (slots past the context are never
read and arrive as zeros) and logits past the context are set with ``where`` (never by
multiplying with a 0/1 mask, which would turn a NaN in an unused cache slot into a NaN
output). Table entries past the last used page are replaced by page 0 of the same head, so
the kernel never dereferences a block-table entry the sequence does not own.

Launch parameters (chunk size, warps, pipeline stages) come from :mod:`pallas_kernels.tuning`
per GPU architecture and shape class.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import cpu_native, mosaic_decode_attention, tuning
from pallas_kernels._common import (
    MASK_VALUE,
    apply_softcap,
    as_5d,
    cdiv,
    has_window,
    layer_arg,
    next_pow2,
    window_arg,
    window_span,
)
from pallas_kernels._kv_chunks import chunk_layout, load_kv_chunk, resolve_chunk_tokens
from pallas_kernels.backend import (
    interpret_mode,
    pallas_lowering,
    resolve_backend,
    triton_params,
)
from pallas_kernels.kv_quant import check_kv_scale, check_token_scales, read_factors

# Target number of programs per launch when choosing the split count automatically
# (about two waves on a 132-SM H100).
_TARGET_PROGRAMS = 264


def _decode_kernel(
    scalars_ref,  # [2] int32: layer, window span
    lens_ref,  # [S] int32
    tables_ref,  # [S, pages_padded] int32
    q_ref,  # [Gp, D] block
    k_ref,  # [L * Hkv * NB, bs, D] (whole cache, flattened over layer/head/block)
    v_ref,
    *refs,  # quantized: scales_ref [2, Hkv, D] f32; then acc_ref [Gp, D], m_ref, l_ref [Gp] fp32
    quantized: bool,
    num_kv_heads: int,
    num_blocks: int,
    chunk_tokens: int,
    chunks_per_split: int,
    scale: float,
    softcap: float | None,
    windowed: bool,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, block_size, head_dim = k_ref.shape
    group = q_ref.shape[0]
    exact = q_ref.dtype == jnp.float32
    if quantized:  # static scales: K's multiply the queries, V's the output (per channel)
        scales_ref, acc_ref, m_ref, l_ref = refs
    else:
        acc_ref, m_ref, l_ref = refs

    ctx_len = lens_ref[seq]
    base_page = (scalars_ref[0] * num_kv_heads + head) * num_blocks
    # The query (position ctx_len - 1) sees [lo, ctx_len); chunks before lo's are skipped.
    lo = jnp.maximum(ctx_len - scalars_ref[1], 0) if windowed else None
    used_chunks = (ctx_len + chunk_tokens - 1) // chunk_tokens
    first = split * chunks_per_split
    if windowed:
        first = jnp.maximum(first, lax.div(lo, jnp.int32(chunk_tokens)))
    num_chunks = jnp.maximum(
        jnp.minimum((split + 1) * chunks_per_split, used_chunks) - first, 0)

    q = q_ref[...]
    if quantized:
        q = (q.astype(jnp.float32) * scales_ref[0, head, :][None, :]).astype(q_ref.dtype)

    def body(c, carry):
        acc, m_prev, l_prev = carry
        k, v, tok = load_kv_chunk(k_ref, v_ref, tables_ref, seq, first + c, ctx_len, base_page,
                                  block_size=block_size, chunk_tokens=chunk_tokens,
                                  first_token=lo)
        if quantized:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        logits = apply_softcap(plgpu.dot(q, k, trans_b=True, allow_tf32=not exact) * scale,
                               softcap)
        seen = tok < ctx_len
        if windowed:
            seen &= tok >= lo
        logits = jnp.where(seen[None, :], logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=-1)
        pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
        return acc * correction[:, None] + pv, m_next, l_next

    init = (
        jnp.zeros((group, head_dim), jnp.float32),
        jnp.full((group,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((group,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(0, num_chunks, body, init)
    acc_ref[...] = acc * scales_ref[1, head, :][None, :] if quantized else acc
    m_ref[...] = m
    l_ref[...] = denom


def auto_splits(num_seqs: int, num_kv_heads: int, max_chunks: int) -> int:
    """Flash-decoding partitions: enough programs for about two waves of a 132-SM GPU."""
    return max(1, min(max_chunks, cdiv(_TARGET_PROGRAMS, num_seqs * num_kv_heads)))


def decode_plan(num_seqs: int, num_kv_heads: int, max_pages: int, block_size: int,
                chunk_tokens: int, num_splits: int | None) -> tuple[int, int, int]:
    """``(splits, chunks_per_split, padded_pages)`` for a decode launch (host-side ints)."""
    pages_per_chunk, _ = chunk_layout(block_size, chunk_tokens)
    max_chunks = cdiv(max_pages * block_size, chunk_tokens)
    splits = num_splits or auto_splits(num_seqs, num_kv_heads, max_chunks)
    splits = max(1, min(splits, max_chunks))
    chunks_per_split = cdiv(max_chunks, splits)
    padded_pages = max(max_pages, cdiv(chunks_per_split * splits * chunk_tokens, block_size))
    padded_pages = cdiv(padded_pages, pages_per_chunk) * pages_per_chunk
    return splits, chunks_per_split, padded_pages


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "softcap", "windowed", "num_splits", "chunk_tokens", "num_warps", "num_stages",
        "interpret"
    ),
)
def _decode_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    layer: jax.Array,
    window: jax.Array,
    kv_scale: jax.Array | None,
    *,
    scale: float,
    softcap: float | None,
    windowed: bool,
    num_splits: int | None,
    chunk_tokens: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> jax.Array:
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    group_p = max(16, next_pow2(group))
    max_pages = block_tables.shape[1]
    splits, chunks_per_split, padded_pages = decode_plan(
        num_seqs, num_kv_heads, max_pages, block_size, chunk_tokens, num_splits)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))

    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    flat_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)

    quantized = kv_scale is not None
    kernel = functools.partial(
        _decode_kernel,
        quantized=quantized,
        num_kv_heads=num_kv_heads,
        num_blocks=num_blocks,
        chunk_tokens=chunk_tokens,
        chunks_per_split=chunks_per_split,
        scale=float(scale),
        softcap=softcap,
        windowed=windowed,
    )
    whole = pl.no_block_spec
    extra = (kv_scale.astype(jnp.float32),) if quantized else ()
    acc, m, denom = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, splits),
        in_specs=[
            whole,
            whole,
            whole,
            pl.BlockSpec((None, None, group_p, head_dim), lambda s, h, p: (s, h, 0, 0)),
            whole,
            whole,
            *[whole] * len(extra),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_p, head_dim), lambda s, h, p: (p, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, group_p), lambda s, h, p: (p, s, h, 0)),
            pl.BlockSpec((None, None, None, group_p), lambda s, h, p: (p, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, group_p, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, group_p), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, group_p), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"paged_decode_g{group_p}_d{head_dim}_c{chunk_tokens}_bs{block_size}"
             f"{'_w' if windowed else ''}{'_cap' if softcap else ''}"
             f"{'_' + k5.dtype.name if quantized else ''}",
    )(
        jnp.stack([layer.reshape(()), window_span(window)]),
        context_lens.astype(jnp.int32),
        tables,
        qg,
        k5.reshape(flat_shape),
        v5.reshape(flat_shape),
        *extra,
    )
    out = combine_splits(acc, m, denom, rows=group)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


# Up to this many splits the merge is unrolled into elementwise ops (`combine_splits`).
UNROLLED_MERGE_MAX_SPLITS = 64


def combine_splits(acc: jax.Array, m: jax.Array, lsum: jax.Array,
                   rows: int | None = None) -> jax.Array:
    """Merge flash-decoding partials along axis 0; rows that saw no token become 0.

    ``acc [P, S, H, R, D]``, ``m`` / ``lsum [P, S, H, R]``; ``rows`` keeps the first rows of
    axis 3 (the query group without its padding). Up to `UNROLLED_MERGE_MAX_SPLITS` splits
    the merge is written as elementwise ops over the static split count, so that XLA fuses
    it into two kernels (the maximum; the sums, the division and the slice): reductions over
    axis 0 compile to a kernel each (max, denominator, numerator) plus the slice, 4 launches
    a layer in a batch-1 GPU step (docs/gpu.md). Beyond, the unrolled code would grow with
    the splits (a long context over one KV head runs up to 264), so it reduces."""
    if rows is not None:
        acc, m, lsum = acc[:, :, :, :rows], m[..., :rows], lsum[..., :rows]
    splits = acc.shape[0]
    if splits > UNROLLED_MERGE_MAX_SPLITS:
        m_max = m.max(axis=0)
        w = jnp.exp(m - m_max[None])
        denom = (w * lsum).sum(axis=0)
        num = (w[..., None] * acc).sum(axis=0)
    else:
        m_max = functools.reduce(jnp.maximum, [m[i] for i in range(splits)])
        denom, num = 0.0, 0.0
        for i in range(splits):
            w = jnp.exp(m[i] - m_max)
            denom = denom + w * lsum[i]
            num = num + w[..., None] * acc[i]
    safe = jnp.where(denom > 0, denom, 1.0)
    return jnp.where(denom[..., None] > 0, num / safe[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "token_scales"))
def paged_decode_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    layer: jax.Array,
    window: jax.Array | int = 0,
    kv_scale: jax.Array | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    token_scales: bool = False,
) -> jax.Array:
    """Pure-jnp reference: gather dense K/V through the block table, masked fp32 softmax.

    The query sits at position ``context_len - 1`` and sees the last ``window`` positions
    (all of them when ``window`` is 0); K/V outside that range are zeroed before use, so stale
    or freed blocks the table still names cannot leak in. A quantized cache is dequantized
    with ``kv_scale [2, Hkv, D]`` after the gather, and with each token's factors when
    ``token_scales`` (`kv_quant`, granularity "per_token")."""
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    _, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    tables = jnp.clip(block_tables, 0, num_blocks - 1)
    kl = lax.dynamic_index_in_dim(k5, layer, 0, keepdims=False)
    vl = lax.dynamic_index_in_dim(v5, layer, 0, keepdims=False)
    # [Hkv, S, pages, bs, D] -> [S, Hkv, T, D]
    k = kl[:, tables].reshape(num_kv_heads, num_seqs, -1, head_dim).transpose(1, 0, 2, 3)
    v = vl[:, tables].reshape(num_kv_heads, num_seqs, -1, head_dim).transpose(1, 0, 2, 3)
    kv_pos = jnp.arange(k.shape[2])[None, :]
    valid = kv_pos < context_lens[:, None]  # [S, T]
    valid &= kv_pos >= context_lens[:, None] - window_span(window)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if kv_scale is not None:
        k = k * kv_scale[0].astype(jnp.float32)[None, :, None, :]
        v = v * kv_scale[1].astype(jnp.float32)[None, :, None, :]
    if token_scales:  # [Hkv, S, pages, bs] -> [S, Hkv, T]
        fk = read_factors(k5, layer)[:, tables].reshape(num_kv_heads, num_seqs, -1)
        fv = read_factors(v5, layer)[:, tables].reshape(num_kv_heads, num_seqs, -1)
        k = k * fk.transpose(1, 0, 2)[..., None]
        v = v * fv.transpose(1, 0, 2)[..., None]
    k = jnp.where(valid[:, None, :, None], k, 0.0)
    v = jnp.where(valid[:, None, :, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_dim)
    logits = jnp.einsum("shgd,shtd->shgt", qg, k, precision=lax.Precision.HIGHEST) * scale
    logits = apply_softcap(logits, softcap)
    logits = jnp.where(valid[:, None, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("shgt,shtd->shgd", probs, v, precision=lax.Precision.HIGHEST)
    out = jnp.where((context_lens > 0)[:, None, None, None], out, 0.0)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
    layer: int | jax.Array | None = None,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
    chunk_tokens: int | None = None,
    pages_per_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: jax.Array | None = None,
    token_scales: bool = False,
) -> jax.Array:
    """Attention of one new query token per sequence over its paged context.

    Args:
      q: ``[num_seqs, num_q_heads, head_dim]``.
      k_cache, v_cache: ``[num_layers, Hkv, num_blocks, block_size, head_dim]`` (or 4-D for
        a single layer).
      block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids.
      context_lens: ``[num_seqs]`` int32; 0 marks a padding row (output zeros).
      scale: softmax scale, usually ``head_dim ** -0.5``.
      layer: python int or traced int32 scalar selecting the cache layer.
      window: sliding window (the query sees its last ``window`` positions, itself
        included); 0 or None: the whole context. Data, so it may be traced per layer.
      softcap: attention logit soft-capping ``c * tanh(logits / c)``; None: off.
      backend: "pallas", "xla", "cpu" or None (auto, see :mod:`pallas_kernels.backend`).
      num_splits: flash-decoding partitions of the context (None: fill the GPU).
      chunk_tokens / pages_per_chunk, num_warps, num_stages: launch parameters; None takes
        them from :mod:`pallas_kernels.tuning` for the target GPU.
      kv_scale: ``[2, Hkv, D]`` float32 static scales of a quantized (int8 / FP8) cache: K and V
        are stored as ``k / kv_scale[0]``, ``v / kv_scale[1]`` (`pallas_kernels.kv_quant`).
      token_scales: the cache also holds per-token factors (granularity "per_token"; CPU
        and XLA backends).
    Returns:
      ``[num_seqs, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    lay = layer_arg(k_cache, layer)
    win = window_arg(window)
    cap = None if softcap is None else float(softcap)
    if q.shape[1] % k_cache.shape[-4]:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    kv_scale = check_kv_scale(k_cache, kv_scale)
    chosen = resolve_backend(backend)
    token_scales = check_token_scales(k_cache, token_scales, chosen)
    if chosen == "cpu" and cpu_native.supports(q, as_5d(k_cache)):
        num_seqs = q.shape[0]
        return cpu_native.ragged_paged_attention_cpu(
            q, as_5d(k_cache), as_5d(v_cache), context_lens, block_tables,
            jnp.arange(num_seqs + 1, dtype=jnp.int32), jnp.int32(num_seqs), lay, win,
            kv_scale, scale=float(scale), softcap=cap, token_scales=token_scales)
    if chosen != "pallas":
        return paged_decode_attention_ref(
            q, k_cache, v_cache, block_tables, context_lens, lay, win, kv_scale,
            scale=float(scale), softcap=cap, token_scales=token_scales)
    if pallas_lowering() == "mosaic" and mosaic_decode_attention.supports(
            q, k_cache, quantized=kv_scale is not None, interpret=interpret_mode()):
        return mosaic_decode_attention.mosaic_paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, lay, win, kv_scale,
            scale=float(scale), softcap=cap, windowed=has_window(window),
            num_splits=num_splits, interpret=interpret_mode())
    tuned = tuning.lookup("decode", q.dtype if kv_scale is not None else k_cache.dtype,
                          q.shape[-1])
    if kv_scale is not None:
        tuned = tuning.quantized_launch(tuned)
    return _decode_pallas(
        q, k_cache, v_cache, block_tables, context_lens, lay, win, kv_scale,
        scale=float(scale), softcap=cap, windowed=has_window(window), num_splits=num_splits,
        chunk_tokens=resolve_chunk_tokens(chunk_tokens, pages_per_chunk, k_cache.shape[-2],
                                          tuned.chunk_tokens),
        num_warps=num_warps or tuned.num_warps, num_stages=num_stages or tuned.num_stages,
        interpret=interpret_mode(),
    )
