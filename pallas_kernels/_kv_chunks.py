"""KV chunks shared by the attention kernels: how a chunk maps onto pages, and its loads.

A chunk is ``chunk_tokens`` consecutive context tokens of one sequence, the unit of the
kernels' inner loop. Both kernels walk the context the same way, so the page arithmetic and
the masked loads live here once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2


def chunk_layout(block_size: int, chunk_tokens: int) -> tuple[int, int]:
    """``(pages_per_chunk, chunks_per_page)`` for a KV chunk of ``chunk_tokens`` tokens.

    Small pages are gathered several per chunk; a page larger than the chunk is walked in
    ``chunks_per_page`` slices, so the tile size (shared memory, registers) is set by the
    tuning table and not by the block size (a 256-token bf16 page at head_dim 128 is 64 KiB
    of K alone, which with V and two pipeline stages overflows an H100's shared memory).
    """
    if chunk_tokens < 16 or next_pow2(chunk_tokens) != chunk_tokens:
        raise ValueError(f"chunk_tokens must be a power of two >= 16; got {chunk_tokens}")
    if block_size >= chunk_tokens:
        return 1, block_size // chunk_tokens
    return chunk_tokens // block_size, 1


def load_kv_chunk(k_ref, v_ref, tables_ref, seq, chunk, used_tokens, base_page, *,
                  block_size: int, chunk_tokens: int, first_token=None):
    """Masked loads of one KV chunk ``[chunk_tokens, D]`` through the block table.

    Token slots outside ``[first_token, used_tokens)`` are not read (masked loads,
    zero-filled), so the kernel never depends on cache contents the table does not name for
    this context (a sliding window's ``first_token`` may sit in a block already freed), and
    Triton can software-pipeline the loads. ``first_token=None`` (no window) leaves the lower
    bound out of the masks altogether: the extra compares cost registers the largest tiles
    do not have (sm_90a, bf16, head_dim 128, 64-token pages). Table entries outside the used
    pages are replaced by page 0 of the same layer/head, so no address comes from junk
    entries.
    """
    head_dim = k_ref.shape[-1]
    # The fill of masked lanes: an int for every dtype but FP8, where Pallas-Triton cannot
    # cast an integer splat (a float zero is the same value).
    zero = 0.0 if jnp.dtype(k_ref.dtype).name.startswith("float8") else 0
    pages_per_chunk, chunks_per_page = chunk_layout(block_size, chunk_tokens)
    used_pages = (used_tokens + block_size - 1) // block_size
    windowed = first_token is not None
    first_page = lax.div(first_token, jnp.int32(block_size)) if windowed else 0
    if chunks_per_page == 1:
        page0 = chunk * pages_per_chunk
        page_pos = page0 + jnp.arange(pages_per_chunk, dtype=jnp.int32)
        ids = tables_ref[seq, pl.ds(page0, pages_per_chunk)]
        live = page_pos < used_pages
        if windowed:
            live &= page_pos >= first_page
        ids = jnp.where(live, ids, 0) + base_page
        tok = page0 * block_size + jnp.arange(chunk_tokens, dtype=jnp.int32)
        tok_live = tok < used_tokens
        if windowed:
            tok_live &= tok >= first_token
        mask = jnp.broadcast_to(tok_live.reshape(pages_per_chunk, block_size, 1),
                                (pages_per_chunk, block_size, head_dim))
        # Index every axis with a (broadcast) array: the same pointer arithmetic as slices
        # for Triton, and a form the CPU interpreter can run as a masked gather.
        idx = (ids[:, None, None], jnp.arange(block_size, dtype=jnp.int32)[None, :, None],
               jnp.arange(head_dim, dtype=jnp.int32)[None, None, :])
        k = plgpu.load(k_ref.at[idx], mask=mask, other=zero).reshape(chunk_tokens, head_dim)
        v = plgpu.load(v_ref.at[idx], mask=mask, other=zero).reshape(chunk_tokens, head_dim)
    else:
        # Plain multiply/subtract: jnp's floor `//` and `%` lower to selects Triton rejects.
        page = lax.div(chunk, jnp.int32(chunks_per_page))
        offset = (chunk - page * chunks_per_page) * chunk_tokens
        live = page < used_pages
        if windowed:
            live &= page >= first_page
        block = jnp.where(live, tables_ref[seq, page], 0) + base_page
        tok = chunk * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        tok_live = tok < used_tokens
        if windowed:
            tok_live &= tok >= first_token
        mask = jnp.broadcast_to(tok_live[:, None], (chunk_tokens, head_dim))
        rows = pl.ds(offset, chunk_tokens)
        k = plgpu.load(k_ref.at[block, rows, :], mask=mask, other=zero)
        v = plgpu.load(v_ref.at[block, rows, :], mask=mask, other=zero)
    return k, v, tok


# Pages gathered into one chunk at most, when the chunk size comes from the tuning table:
# every page is a separately addressed row block, and 16 pages of 8 tokens made the ragged
# kernel spill on sm_90a (bench/results/aot-h100) where 8 pages did not.
MAX_PAGES_PER_CHUNK = 8


def resolve_chunk_tokens(chunk_tokens: int | None, pages_per_chunk: int | None,
                         block_size: int, tuned: int) -> int:
    """Explicit ``chunk_tokens`` or ``pages_per_chunk`` as given; otherwise the tuned size,
    capped at :data:`MAX_PAGES_PER_CHUNK` pages (never below 16 tokens)."""
    if chunk_tokens is not None and pages_per_chunk is not None:
        raise ValueError("pass chunk_tokens or pages_per_chunk, not both")
    if pages_per_chunk is not None:
        if next_pow2(pages_per_chunk) != pages_per_chunk:
            raise ValueError(f"pages_per_chunk must be a power of two; got {pages_per_chunk}")
        chunk_tokens = pages_per_chunk * block_size
    if chunk_tokens is None:
        chunk_tokens = max(16, min(tuned, MAX_PAGES_PER_CHUNK * block_size))
    return chunk_tokens
