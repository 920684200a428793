"""Ragged paged attention: decode rows and prefill chunks of many sequences in one launch.

The flat query batch is cut into *work items*: runs of up to ``block_q`` consecutive query
tokens of one sequence. The item list is computed with a few jnp ops from ``cu_q_lens``
(static length ``num_tokens // block_q + min(max_seqs, num_tokens)``, an upper bound on the
number of items, so shapes stay static); surplus items have zero rows and return at once.
The grid is ``(kv_head, item)``. One program loads its ``block_q`` tokens times the padded
GQA group as a single ``[block_q * group_p, head_dim]`` tile (rows ordered token-major),
walks the sequence's context up to its last query's position in chunks of ``chunk_tokens``
(masked loads through the block table, shared with the decode kernel) with an online
softmax, and stores only its valid rows. Query token ``i`` of a sequence with ``q_len`` new tokens
and ``kv_len`` total tokens sits at position ``kv_len - q_len + i`` and sees positions
``<=`` its own, so a decode row is simply an item with one token.

The output buffer is a zero-filled input aliased to the output: rows no item owns (padding
beyond ``cu_q_lens[num_seqs]``) therefore stay exactly zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import cpu_native, mosaic_decode_attention, mosaic_ragged_attention, tuning
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
from pallas_kernels.paged_decode_attention import paged_decode_attention_ref

_XLA_BLOCK_Q = 32


def live_q_lens(cu_q_lens: jax.Array, num_seqs: jax.Array, max_seqs: int
                ) -> tuple[jax.Array, jax.Array]:
    """(int32 cu_q_lens, query length of each sequence slot, 0 past `num_seqs`)."""
    cu = cu_q_lens.astype(jnp.int32)
    live = jnp.arange(max_seqs) < num_seqs
    return cu, jnp.where(live, cu[1 : max_seqs + 1] - cu[:max_seqs], 0)


def work_items(
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    num_tokens: int,
    block_q: int,
) -> jax.Array:
    """Split every live sequence's query run into items of ``<= block_q`` tokens.

    Returns int32 ``[4, num_items]``: sequence id, first flat query row, number of valid
    rows (0 for surplus items) and the cache position of the item's first query token.
    """
    max_seqs = kv_lens.shape[0]
    cu, q_lens = live_q_lens(cu_q_lens, num_seqs, max_seqs)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    num_items = num_tokens // block_q + min(max_seqs, num_tokens)
    i = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    j = i - starts[seq]
    valid = i < ends[-1]
    n_rows = jnp.where(valid, jnp.minimum(block_q, q_lens[seq] - j * block_q), 0)
    q_start = jnp.where(valid, cu[seq] + j * block_q, 0)
    pos0 = jnp.where(valid, kv_lens[seq] - q_lens[seq] + j * block_q, 0)
    return jnp.stack([seq, q_start, n_rows, pos0]).astype(jnp.int32)


def _ragged_kernel(
    scalars_ref,  # [2] int32: layer, window span
    items_ref,  # [4, num_items]
    tables_ref,  # [max_seqs, pages_padded]
    q_ref,  # [Hkv, (T + block_q) * group_p, D]
    k_ref,  # [L * Hkv * NB, bs, D]
    v_ref,
    *refs,  # quantized: scales_ref [2, Hkv, D] f32; then out_in_ref (aliased), out_ref
    quantized: bool,
    num_kv_heads: int,
    num_blocks: int,
    group_p: int,
    block_q: int,
    chunk_tokens: int,
    scale: float,
    softcap: float | None,
    windowed: bool,
):
    head, item = pl.program_id(0), pl.program_id(1)
    _, block_size, head_dim = k_ref.shape
    rows = block_q * group_p
    exact = q_ref.dtype == jnp.float32
    if quantized:  # static scales: K's multiply the queries, V's the output (per channel)
        scales_ref, _, out_ref = refs
    else:
        _, out_ref = refs

    seq = items_ref[0, item]
    q_start = items_ref[1, item]
    n_rows = items_ref[2, item]
    pos0 = items_ref[3, item]
    kv_end = jnp.where(n_rows > 0, pos0 + n_rows, 0)
    span = scalars_ref[1]
    # The item's first query sees back to position pos0 - span + 1; earlier chunks are skipped.
    lo = jnp.maximum(pos0 - span + 1, 0) if windowed else None
    first_chunk = lax.div(lo, jnp.int32(chunk_tokens)) if windowed else 0
    num_chunks = jnp.maximum((kv_end + chunk_tokens - 1) // chunk_tokens - first_chunk, 0)
    base_page = (scalars_ref[0] * num_kv_heads + head) * num_blocks

    row_slice = pl.ds(q_start * group_p, rows)
    q = q_ref[head, row_slice, :]
    if quantized:
        q = (q.astype(jnp.float32) * scales_ref[0, head, :][None, :]).astype(q_ref.dtype)
    tok = jnp.arange(rows, dtype=jnp.int32) // group_p
    q_pos = pos0 + tok
    row_valid = tok < n_rows
    q_first = q_pos - span + 1 if windowed else None  # each row's first visible position

    def body(c, carry):
        acc, m_prev, l_prev = carry
        k, v, kv_pos = load_kv_chunk(k_ref, v_ref, tables_ref, seq, first_chunk + c, kv_end,
                                     base_page, block_size=block_size,
                                     chunk_tokens=chunk_tokens, first_token=lo)
        if quantized:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        # Causal and inside the window. Valid rows sit below kv_end, so kv_pos < kv_end
        # follows; invalid rows are never stored and their slots past kv_end load as zeros.
        visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos < kv_end)[None, :]
        if windowed:
            visible &= kv_pos[None, :] >= q_first[:, None]
        logits = apply_softcap(plgpu.dot(q, k, trans_b=True, allow_tf32=not exact) * scale,
                               softcap)
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=-1)
        pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
        return acc * correction[:, None] + pv, m_next, l_next

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, _, denom = lax.fori_loop(0, num_chunks, body, init)
    l_safe = jnp.where(denom > 0, denom, 1.0)
    out = acc / l_safe[:, None]
    if quantized:
        out = out * scales_ref[1, head, :][None, :]
    out = out.astype(out_ref.dtype)
    plgpu.store(out_ref.at[head, row_slice, :], out, mask=row_valid[:, None])


def windowed_launch(tuned: tuning.KernelTuning, windowed: bool,
                    softcap: float | None = None) -> tuning.KernelTuning:
    """The launch of the windowed or soft-capped variants: the tuned one with a pipeline stage
    fewer when it has 3 or more, else half the query rows (at least 16). Window masks cost
    registers the tuned tiles do not have: at the tuned launch the windowed kernel spilled on
    sm_90a (bf16, head_dim 128 with 64-token pages; head_dim 256 with group 8), and so did the
    window-free soft-capped one at head_dim 256 (Gemma 2's global layers, unrolled); with this
    rule the bf16 sweep over head dims 64-256, blocks 16-256 and groups 1/2/8 and the engine
    steps compile clean on sm_90a and sm_80 (`make aot-report`)."""
    if not windowed and softcap is None:
        return tuned
    if tuned.num_stages > 2:
        return dataclasses.replace(tuned, num_stages=tuned.num_stages - 1)
    return dataclasses.replace(tuned, q_rows=max(16, tuned.q_rows // 2))


def ragged_block_q(block_q: int | None, group: int, q_rows: int) -> int:
    """Query tokens per program: the tuned row count divided by the padded GQA group."""
    group_p = next_pow2(group)
    if block_q is None:
        block_q = max(1, q_rows // group_p)
    if block_q * group_p < 16 or next_pow2(block_q) != block_q:
        raise ValueError("block_q must be a power of two with block_q * group_p >= 16")
    return block_q


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "softcap", "windowed", "block_q", "chunk_tokens", "num_warps", "num_stages",
        "interpret"
    ),
)
def _ragged_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer: jax.Array,
    window: jax.Array,
    kv_scale: jax.Array | None,
    *,
    scale: float,
    softcap: float | None,
    windowed: bool,
    block_q: int,
    chunk_tokens: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> jax.Array:
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    group_p = next_pow2(group)
    max_pages = block_tables.shape[1]
    pages_per_chunk, _ = chunk_layout(block_size, chunk_tokens)
    padded_pages = cdiv(max_pages, pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))

    items = work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, block_q)
    num_items = items.shape[1]
    padded_tokens = num_tokens + block_q
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group_p, head_dim)
    out_init = jnp.zeros_like(qg)
    flat_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)

    quantized = kv_scale is not None
    kernel = functools.partial(
        _ragged_kernel,
        quantized=quantized,
        num_kv_heads=num_kv_heads,
        num_blocks=num_blocks,
        group_p=group_p,
        block_q=block_q,
        chunk_tokens=chunk_tokens,
        scale=float(scale),
        softcap=softcap,
        windowed=windowed,
    )
    whole = pl.no_block_spec
    extra = (kv_scale.astype(jnp.float32),) if quantized else ()
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_items),
        in_specs=[whole] * (7 + len(extra)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        input_output_aliases={6 + len(extra): 0},
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"ragged_paged_attention_q{block_q}_g{group_p}_d{head_dim}_c{chunk_tokens}"
             f"_bs{block_size}{'_w' if windowed else ''}{'_cap' if softcap else ''}"
             f"{'_' + k5.dtype.name if quantized else ''}",
    )(jnp.stack([layer.reshape(()), window_span(window)]), items, tables, qg,
      k5.reshape(flat_shape), v5.reshape(flat_shape), *extra, out_init)
    out = out.reshape(num_kv_heads, padded_tokens, group_p, head_dim).transpose(1, 0, 2, 3)
    return out[:num_tokens, :, :group].reshape(num_tokens, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_q", "token_scales"))
def ragged_paged_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer: jax.Array,
    window: jax.Array | int = 0,
    kv_scale: jax.Array | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    block_q: int = _XLA_BLOCK_Q,
    token_scales: bool = False,
) -> jax.Array:
    """Pure-jnp reference: per work item, gather dense K/V, causal masked fp32 softmax.

    Working per item (not per token) keeps the gathered K/V at
    ``num_items x context`` instead of ``num_tokens x context``, which is what makes this
    path usable as the CPU engine's attention.
    """
    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    _, num_kv_heads, num_blocks, block_size, head_dim = k5.shape
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    seq, q_start, n_rows, pos0 = work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, block_q)
    num_items = seq.shape[0]

    tok = jnp.arange(block_q, dtype=jnp.int32)
    rows = q_start[:, None] + tok[None, :]  # [I, bq]
    row_valid = tok[None, :] < n_rows[:, None]
    qi = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))[rows].astype(jnp.float32)
    qi = qi.reshape(num_items, block_q, num_kv_heads, group, head_dim)

    tables = jnp.clip(block_tables[seq], 0, num_blocks - 1)  # [I, pages]
    kl = lax.dynamic_index_in_dim(k5, layer, 0, keepdims=False)
    vl = lax.dynamic_index_in_dim(v5, layer, 0, keepdims=False)
    k = kl[:, tables].reshape(num_kv_heads, num_items, -1, head_dim).transpose(1, 0, 2, 3)
    v = vl[:, tables].reshape(num_kv_heads, num_items, -1, head_dim).transpose(1, 0, 2, 3)
    kv_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    kv_end = jnp.where(n_rows > 0, pos0 + n_rows, 0)
    span = window_span(window)
    in_range = (kv_pos[None, :] < kv_end[:, None]) & (kv_pos[None, :] > pos0[:, None] - span)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if kv_scale is not None:  # a quantized cache: dequantize what was gathered
        k = k * kv_scale[0].astype(jnp.float32)[None, :, None, :]
        v = v * kv_scale[1].astype(jnp.float32)[None, :, None, :]
    if token_scales:  # and each token's factors: [Hkv, I, pages, bs] -> [I, Hkv, T]
        fk = read_factors(k5, layer)[:, tables].reshape(num_kv_heads, num_items, -1)
        fv = read_factors(v5, layer)[:, tables].reshape(num_kv_heads, num_items, -1)
        k = k * fk.transpose(1, 0, 2)[..., None]
        v = v * fv.transpose(1, 0, 2)[..., None]
    k = jnp.where(in_range[:, None, :, None], k, 0.0)
    v = jnp.where(in_range[:, None, :, None], v, 0.0)
    q_pos = pos0[:, None] + tok[None, :]  # [I, bq]
    visible = ((kv_pos[None, None, :] <= q_pos[:, :, None]) & in_range[:, None, :]
               & (kv_pos[None, None, :] > q_pos[:, :, None] - span))

    logits = jnp.einsum("iqhgd,ihtd->ihgqt", qi, k, precision=lax.Precision.HIGHEST) * scale
    logits = apply_softcap(logits, softcap)
    logits = jnp.where(visible[:, None, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("ihgqt,ihtd->iqhgd", probs, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(num_items * block_q, num_q_heads, head_dim).astype(q.dtype)
    dest = jnp.where(row_valid, rows, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")


# XLA path (CPU): a step whose query tokens times block-table slots is at most this attends
# per token, as the decode path does (each token: its sequence's table, its own causal
# length). Work items of `_XLA_BLOCK_Q` rows cost a whole item for every one-token decode in
# a mixed step: 6-13x the per-token cost measured on 2 CPU cores at 64 tokens (see
# docs/v1-core.md). Larger steps (long prefills) keep the items, whose gathered K/V grows with
# items, not tokens. The bound equals the decode path's largest gather at the default limits
# (64 sequences x 1024 slots).
_XLA_PER_TOKEN_MAX_SLOTS = 1 << 16


def ragged_paged_attention_per_token(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer: jax.Array,
    window: jax.Array | int = 0,
    kv_scale: jax.Array | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    token_scales: bool = False,
) -> jax.Array:
    """Ragged attention as one decode query per token: token t of sequence s attends to the
    first `position(t) + 1` cache slots of s's table (causal by length). Rows past
    ``cu_q_lens[num_seqs]`` get context 0, hence zeros."""
    num_tokens = q.shape[0]
    max_seqs = kv_lens.shape[0]
    cu, q_lens = live_q_lens(cu_q_lens, num_seqs, max_seqs)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1 : max_seqs + 1], t, side="right"), 0, max_seqs - 1)
    total = jnp.sum(q_lens)
    pos = kv_lens[seq] - q_lens[seq] + (t - cu[seq])
    ctx = jnp.where(t < total, pos + 1, 0).astype(jnp.int32)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables[seq], ctx, layer,
                                      window, kv_scale, scale=scale, softcap=softcap,
                                      token_scales=token_scales)


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    layer: int | jax.Array | None = None,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    block_q: int | None = None,
    chunk_tokens: int | None = None,
    pages_per_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: jax.Array | None = None,
    token_scales: bool = False,
) -> jax.Array:
    """Causal attention for a flat batch of query tokens from many sequences.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``; sequence ``s`` owns rows
        ``cu_q_lens[s]:cu_q_lens[s + 1]``.
      k_cache, v_cache: ``[num_layers, Hkv, num_blocks, block_size, head_dim]`` (or 4-D),
        already holding the new tokens (written with ``write_kv``).
      kv_lens: ``[max_seqs]`` int32 context lengths including the new tokens.
      block_tables: ``[max_seqs, max_blocks_per_seq]`` int32.
      cu_q_lens: ``[max_seqs + 1]`` int32 cumulative query lengths.
      num_seqs: int32 scalar array, number of live sequences.
      window: sliding window (each query sees its last ``window`` positions, itself
        included); 0 or None: causal over the whole context.
      softcap: attention logit soft-capping ``c * tanh(logits / c)``; None: off.
      block_q, chunk_tokens / pages_per_chunk, num_warps, num_stages: launch parameters;
        None takes them from :mod:`pallas_kernels.tuning` for the target GPU.
      kv_scale: ``[2, Hkv, D]`` float32 static scales of a quantized (int8 / FP8) cache
        (`pallas_kernels.kv_quant`).
      token_scales: the cache also holds per-token factors (granularity "per_token"; CPU
        and XLA backends).
    Returns:
      ``[num_tokens, num_q_heads, head_dim]``; rows past ``cu_q_lens[num_seqs]`` are zero.
    """
    lay = layer_arg(k_cache, layer)
    win = window_arg(window)
    cap = None if softcap is None else float(softcap)
    if q.shape[1] % k_cache.shape[-4]:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    kv_scale = check_kv_scale(k_cache, kv_scale)
    chosen = resolve_backend(backend)
    token_scales = check_token_scales(k_cache, token_scales, chosen)
    if chosen == "cpu" and cpu_native.supports(q, as_5d(k_cache)):
        return cpu_native.ragged_paged_attention_cpu(
            q, as_5d(k_cache), as_5d(v_cache), kv_lens, block_tables, cu_q_lens, num_seqs, lay,
            win, kv_scale, scale=float(scale), softcap=cap, token_scales=token_scales)
    if chosen != "pallas":
        slots = q.shape[0] * block_tables.shape[1] * k_cache.shape[-2]
        if slots <= _XLA_PER_TOKEN_MAX_SLOTS and block_q is None:
            return ragged_paged_attention_per_token(
                q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, lay, win,
                kv_scale, scale=float(scale), softcap=cap, token_scales=token_scales)
        return ragged_paged_attention_ref(
            q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, lay, win,
            kv_scale, scale=float(scale), softcap=cap, token_scales=token_scales,
        )
    windowed = has_window(window)
    if pallas_lowering() == "mosaic" and mosaic_decode_attention.supports(
            q, k_cache, quantized=kv_scale is not None, interpret=interpret_mode(),
            ragged=True):
        return mosaic_ragged_attention.mosaic_ragged_attention(
            q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, lay, win,
            kv_scale, scale=float(scale), softcap=cap, windowed=windowed,
            interpret=interpret_mode())
    tuned = tuning.lookup("ragged", q.dtype if kv_scale is not None else k_cache.dtype,
                          q.shape[-1])
    tuned = windowed_launch(tuning.quantized_launch(tuned) if kv_scale is not None else tuned,
                            windowed, cap)
    group = q.shape[1] // k_cache.shape[-4]
    return _ragged_pallas(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, lay, win, kv_scale,
        scale=float(scale), softcap=cap, windowed=windowed,
        block_q=ragged_block_q(block_q, group, tuned.q_rows),
        chunk_tokens=resolve_chunk_tokens(chunk_tokens, pages_per_chunk, k_cache.shape[-2],
                                          tuned.chunk_tokens),
        num_warps=num_warps or tuned.num_warps,
        num_stages=num_stages or tuned.num_stages,
        interpret=interpret_mode(),
    )
