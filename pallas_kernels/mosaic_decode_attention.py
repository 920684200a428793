"""Paged decode attention for Hopper in Mosaic GPU (`plgpu.kernel`): TMA page gathers, wgmma.

The same contract as :mod:`pallas_kernels.paged_decode_attention` (one query token per
sequence, flash-decoding splits, combined by its `combine_splits`), written for the Pallas
backend that replaces Pallas-Triton. One CUDA block (one warpgroup) handles one
``(sequence, KV head, split)``:

- the GQA group's queries fill the rows of a 64-row tile (wgmma's M; unused rows are zero);
- the context is walked in chunks of ``max(64, block_size)`` tokens: each chunk's pages are
  copied by TMA, one bulk copy per block-table entry, into a slot of a two-stage SMEM ring
  (one barrier per slot counts the chunk's copies), so the next chunk's gather overlaps this
  one's math;
- ``q k^T`` and ``p v`` run on wgmma with fp32 accumulators; the online softmax (base 2) stays
  in registers; ``p`` is staged through SMEM for the second wgmma (the GPU interpreter's wgmma
  takes only an SMEM left operand, and one code path is what the interpreter tests).

Masking is by length, never by block contents: logits of positions at or past the context
are replaced (``where``) before the softmax, and because TMA copies whole pages, V rows past
the context (or behind a window) in an edge chunk are zeroed in SMEM before ``p v``
(``0 * NaN`` would otherwise leak a stale NaN). Table entries past the sequence's last page
are not dereferenced: page 0 of the same head is copied instead (and masked), so a junk id
cannot be read.

Sliding windows (data: one compilation serves windowed and global layers) skip chunks
wholly before the window and mask the rest by position; soft-capping (static) applies
``c * tanh(s / c)`` before the mask. Scope (the rest falls back to the Triton kernel,
`supports`): bf16/fp16 caches, or int8 / FP8 ones under bf16/fp16 queries, head dims 64,
128 and 256, block sizes 16-128 (16-64 at head dim 256; quantized: head dims 64 and 128,
block sizes 16-64, where the widening does not spill). Chunks under 64 tokens fail Mosaic
GPU's layout inference in jax 0.12 (checked with the deviceless H100 compile).

Quantized caches (`kv_quant`: int8 / FP8 values, static per-channel scales): the rings hold
the 1-byte pages as TMA brings them (half the SMEM and half the copy bytes), and each chunk
is widened in registers into a 16-bit staging tile that the wgmmas read (Hopper's wgmma
takes no int8 or mixed operands beside a bf16 query; FP8 goes through fp16, `widen`). The
scales never enter the loop: K's multiply the queries before the kernel, V's the output
after it, exactly as the Triton kernels fold them.

Head dim 256: one warpgroup holding a 64 x 256 fp32 accumulator (128 registers a thread)
spilled ~400 bytes, so the output columns are split over two programs (`V_COLS`, folded into
the grid's split axis): each computes the whole ``q k^T`` (its softmax statistics are then
the same in both) and ``p v`` for its 128 columns, gathering only those columns of V. The
price is K read twice: 1.5x the KV bytes of one program, traded for no spills and the same
register footprint as head dim 128. 128-token chunks would need 272 KiB of SMEM there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import as_5d, cdiv, own_buffer, window_span
from pallas_kernels.kv_quant import is_quantized

ROWS = 64  # wgmma's M: the GQA group is padded to it
STAGES = 2  # SMEM ring depth
HEAD_DIMS = (64, 128, 256)
V_COLS = 128  # output (and V) columns per program: head dim 256 takes two (module docstring)
BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TARGET_PROGRAMS = 264  # about two waves on a 132-SM H100, as the Triton kernel


@functools.cache
def mosaic_available() -> bool:
    """Whether the installed jax has the Mosaic GPU API these kernels are written against
    (``plgpu.kernel(out_type=..., scratch_types=...)``, ``plgpu.ACC``: jax 0.11.2, the lent
    GPU machine's, and 0.12 have it); elsewhere the kernels fall back to Triton and their
    tests skip saying why, rather than stopping the GPU suite's kernel stage."""
    import inspect

    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    params = inspect.signature(plgpu.kernel).parameters
    return "out_type" in params and "scratch_types" in params and hasattr(plgpu, "ACC")


def hopper_target() -> bool:
    """Whether the GPU the trace targets is a Hopper (sm_90): wgmma exists nowhere else. A
    device that does not say (a deviceless compile target) is taken at its word: its compile
    fails if it is not."""
    from pallas_kernels.backend import target_device

    dev = target_device()
    if dev is None:
        return False
    cc = getattr(dev, "compute_capability", None)
    return cc is None or str(cc).startswith("9")


def shape_ok(head_dim: int, block_size: int, *, ragged: bool, quantized: bool = False) -> bool:
    """Shapes the kernels serve. Head dim 256 with 128-token chunks needs 272 KiB of SMEM
    (K and V rings); the ragged kernel with 128-token chunks at head dim 128 spills its
    logits, accumulator and mask (212 bytes on sm_90a, `pagedjax.aot.mosaic`); a quantized
    cache's widening spills at head dim 256 (8-260 bytes) and with 128-token chunks (20-44).
    Those keep the Triton kernel."""
    if head_dim not in HEAD_DIMS or block_size not in BLOCK_SIZES:
        return False
    if (head_dim == 256 or quantized) and chunk_tokens(block_size) > ROWS:
        return False
    if quantized and head_dim == 256:
        return False
    return not (ragged and head_dim == 128 and chunk_tokens(block_size) > ROWS)


def col_parts(head_dim: int) -> int:
    """Programs that share one (sequence or item, KV head): one per `V_COLS` columns."""
    return max(1, head_dim // V_COLS)


def supports(q: jax.Array, k_cache: jax.Array, *, quantized: bool, interpret: bool = True,
             ragged: bool = False) -> bool:
    """Whether a Mosaic kernel serves the call (else the caller takes the Triton kernel); a
    compiled (not interpreted) call also needs a Hopper target. A quantized (int8 / FP8)
    cache is served under bf16 / fp16 queries."""
    group = q.shape[1] // k_cache.shape[-4]
    cache_ok = (is_quantized(k_cache.dtype) if quantized
                else jnp.dtype(k_cache.dtype) == jnp.dtype(q.dtype))
    return (jnp.dtype(q.dtype) in DTYPES and cache_ok
            and shape_ok(q.shape[-1], k_cache.shape[-2], ragged=ragged, quantized=quantized)
            and group <= ROWS
            and mosaic_available() and (interpret or hopper_target()))


def chunk_tokens(block_size: int) -> int:
    return max(ROWS, block_size)


def _smem_transforms(cols: int, dtype):
    """Tiling + swizzle for a wgmma operand whose rows hold ``cols`` elements."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    width = cols * jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if width % s == 0)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def widen(x: jax.Array, dtype) -> jax.Array:
    """1-byte cache values to the wgmma dtype, exactly. sm_90 converts FP8 to fp16 only (no
    ``cvt.bf16x2.e4m3x2`` before sm_100), so FP8 reaches bf16 through fp16, which holds every
    e4m3 and e5m2 value exactly, as bf16 does."""
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int8) and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        x = x.astype(jnp.float16)
    return x.astype(dtype)


def attend_chunks(n, first, issue, q_src, q_bar, visible, kv_lo, kv_end, q_smem, k_smem,
                  v_smem, p_smem, k_bar, v_bar, *, scale: float, softcap: float | None,
                  m_init: float, stage=None):
    """The pipeline both Mosaic kernels share: the first STAGES chunks' copies are issued and
    the query tile ``q_src`` loaded into ``q_smem``, then ``n`` chunks of ``k_smem.shape[1]``
    keys are walked, chunk ``first + c`` copied into slot ``c % STAGES`` by
    ``issue(c, slot)``; logits soft-capped (``softcap``), then masked by
    ``visible(key_pos)`` (``[ROWS, chunk]``); V rows outside ``[kv_lo, kv_end)`` (past the
    context, or behind a window, where blocks may have been released) are zeroed in SMEM.
    Returns the unnormalised accumulator ``[ROWS, DV]`` (``DV``: the V ring's columns, all of
    the head dim or a `V_COLS` slice of it) and the base-2 running max and denominator
    ``[ROWS]``. ``stage`` (a quantized cache): bf16/fp16 SMEM tiles ``(k, v)`` into which
    each chunk's 1-byte K and V are widened before the wgmmas (which take no int8 or mixed
    operands with a 16-bit query); the scales are applied outside (`kv_quant`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    chunk, dv = k_smem.shape[1], v_smem.shape[-1]
    log2e = math.log2(math.e)
    wgmma = plgpu.Layout.WGMMA
    for s in range(STAGES):
        pl.when(s < n)(functools.partial(issue, s, s))
    plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar)
    plgpu.barrier_wait(q_bar)

    def step(c, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(c, jnp.int32(STAGES))
        start = (first + c) * chunk
        plgpu.barrier_wait(k_bar.at[slot])
        k_tile = k_smem.at[slot]
        if stage is not None:  # widen the 1-byte keys into the staging tile
            stage[0][...] = widen(k_smem[slot], stage[0].dtype)
            plgpu.commit_smem()
            k_tile = stage[0]

        def qk_scope(ref):
            plgpu.wgmma(ref, q_smem, k_tile.transpose((1, 0)))
            return ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, chunk), jnp.float32)) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s * (1.0 / softcap))
        s = s * log2e
        key = start + plgpu.broadcasted_iota(jnp.int32, (ROWS, chunk), 1, layout=wgmma)
        s = jnp.where(visible(key), s, m_init)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])

        if stage is None:
            @pl.when((start + chunk > kv_end) | (start < kv_lo))
            def _zero_edges():  # whole pages arrived: rows outside the keys may hold anything
                v = v_smem[slot]
                row = start + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=wgmma)
                v_smem[slot] = jnp.where((row < kv_end) & (row >= kv_lo), v, jnp.zeros_like(v))
            v_tile = v_smem.at[slot]
        else:  # widen every chunk, zeroing the rows outside the keys on the way
            v = widen(v_smem[slot], stage[1].dtype)
            row = start + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=wgmma)
            stage[1][...] = jnp.where((row < kv_end) & (row >= kv_lo), v, jnp.zeros_like(v))
            v_tile = stage[1]

        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv_scope(ref):
            plgpu.wgmma(ref, p_smem, v_tile)
            return ref[...]

        pv = pl.run_scoped(pv_scope, plgpu.ACC((ROWS, dv), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
        pl.when(c + STAGES < n)(functools.partial(issue, c + STAGES, slot))
        return acc, m_new, l_i

    init = (plgpu.layout_cast(jnp.zeros((ROWS, dv), jnp.float32), wgmma),
            plgpu.layout_cast(jnp.full((ROWS,), m_init, jnp.float32), wgmma.reduce(1)),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1)))
    return lax.fori_loop(0, n, step, init)


def page_copier(tables_ref, row, first, used_pages, base, num_blocks: int, block_size: int,
                k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, v_col0=0):
    """``issue(c, slot)``: TMA chunk ``first + c``'s pages of table row ``row`` into ``slot``,
    one arrival per page on the slot's barriers; entries past ``used_pages`` are never read
    (page 0 of the head is copied instead, and masked). V pages are copied from column
    ``v_col0`` on, as many columns as the V ring holds."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    pages_per_chunk = k_smem.shape[1] // block_size
    dv, d = v_smem.shape[-1], k_smem.shape[-1]

    def issue(c, slot):
        for j in range(pages_per_chunk):
            idx = (first + c) * pages_per_chunk + j
            page = jnp.where(idx < used_pages, tables_ref[row, idx], 0)
            page = base + jnp.clip(page, 0, num_blocks - 1)
            rows = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page], k_smem.at[slot, rows], k_bar.at[slot])
            v_src = v_ref.at[page] if dv == d else v_ref.at[page, :, pl.ds(v_col0, dv)]
            plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot, rows], v_bar.at[slot])

    return issue


def _kernel(scalars_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref,  # inputs (GMEM)
            acc_out, m_out, l_out,  # outputs (GMEM)
            q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, *scratch,  # (+ stage), barriers
            num_kv_heads: int, num_blocks: int, block_size: int, chunks_per_split: int,
            scale: float, softcap: float | None, windowed: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    stage, (q_bar, k_bar, v_bar) = split_scratch(q_smem, k_smem, scratch)
    seq, head, program = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    parts = k_smem.shape[-1] // v_smem.shape[-1]  # column programs per split (head dim 256)
    split, part = lax.div(program, jnp.int32(parts)), lax.rem(program, jnp.int32(parts))
    chunk = k_smem.shape[1]
    ctx = lens_ref[seq]
    used_pages = lax.div(ctx + block_size - 1, jnp.int32(block_size))
    used_chunks = lax.div(ctx + chunk - 1, jnp.int32(chunk))
    # The query (position ctx - 1) sees [lo, ctx); chunks wholly before lo are not read.
    lo = jnp.maximum(ctx - scalars_ref[1], 0) if windowed else jnp.int32(0)
    first = split * chunks_per_split
    end = jnp.minimum(first + chunks_per_split, used_chunks)
    if windowed:
        first = jnp.maximum(first, lax.div(lo, jnp.int32(chunk)))
    n = jnp.maximum(end - first, 0)
    base = (scalars_ref[0] * num_kv_heads + head) * num_blocks
    issue = page_copier(tables_ref, seq, first, used_pages, base, num_blocks, block_size,
                        k_ref, v_ref, k_smem, v_smem, k_bar, v_bar,
                        v_col0=part * v_smem.shape[-1])
    acc, m_i, l_i = attend_chunks(n, first, issue, q_ref.at[seq, head], q_bar,
                                  lambda key: (key < ctx) & (key >= lo), lo, ctx, q_smem, k_smem,
                                  v_smem, p_smem, k_bar, v_bar, scale=scale, softcap=softcap,
                                  m_init=-jnp.inf, stage=stage)
    store_tile(acc, o_smem, acc_out.at[program, seq, head])
    ml_smem[0] = m_i
    ml_smem[1] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_out.at[program, seq, head])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_out.at[program, seq, head])
    plgpu.wait_smem_to_gmem(0)


def store_tile(acc, o_smem, dst) -> None:
    """Write the fp32 ``[ROWS, D]`` tile ``acc`` to the GMEM ref ``dst`` through ``o_smem``
    (``[ROWS, min(D, 128)]``: at head dim 256 a whole fp32 tile would not fit in SMEM beside
    the K/V rings), a column slice at a time. Leaves its copies in flight."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    w = o_smem.shape[-1]
    for j in range(acc.shape[-1] // w):
        if j:
            plgpu.wait_smem_to_gmem(0)  # the previous slice has left o_smem
        o_smem[...] = acc[:, j * w:(j + 1) * w]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, dst.at[:, pl.ds(j * w, w)])


def scratch_types(d: int, chunk: int, dtype, *, stats: bool, cache_dtype=None) -> tuple:
    """SMEM of a Mosaic attention program: the q tile, the K ring, the V ring (its program's
    columns), p and the fp32 output tile (``stats``: also the running max and denominator,
    which decode splits write out). A 1-byte ``cache_dtype``: the rings hold it, and two
    tiles of ``dtype`` (one chunk of K, one of V) are what the wgmmas read."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cache_dtype = jnp.dtype(cache_dtype or dtype)
    dv = d // col_parts(d)
    tail = [plgpu.SMEM((ROWS, dv), jnp.float32)]
    if stats:
        tail.append(plgpu.SMEM((2, ROWS), jnp.float32))
    if cache_dtype != jnp.dtype(dtype):
        tail += [plgpu.SMEM((chunk, d), dtype, transforms=_smem_transforms(d, dtype)),
                 plgpu.SMEM((chunk, dv), dtype, transforms=_smem_transforms(dv, dtype))]
    ring = lambda cols: plgpu.SMEM((STAGES, chunk, cols), cache_dtype,  # noqa: E731
                                   transforms=_smem_transforms(cols, cache_dtype))
    return (plgpu.SMEM((ROWS, d), dtype, transforms=_smem_transforms(d, dtype)),
            ring(d), ring(dv),
            plgpu.SMEM((ROWS, chunk), dtype, transforms=_smem_transforms(chunk, dtype)),
            *tail)


def split_scratch(q_smem, k_smem, scratch) -> tuple:
    """The kernels' trailing scratch refs: (the staging tiles, which `scratch_types` adds when
    the rings hold another dtype than the queries, or None; the three barriers)."""
    if k_smem.dtype != q_smem.dtype:
        return (scratch[0], scratch[1]), scratch[2:]
    return None, scratch


def scale_channels(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., Hkv, rows, D]`` times a quantized cache's per-(KV head, channel) scales
    ``[Hkv, D]``, in float32: K's fold into the queries, V's into the output (`kv_quant`)."""
    return x.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :]


def barriers(pages_per_chunk: int) -> tuple:
    """The q copy's barrier and one per ring slot for K and for V (a chunk's page copies
    each arrive once)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_chunk, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=pages_per_chunk, num_barriers=STAGES))


def decode_splits(num_seqs: int, num_kv_heads: int, max_chunks: int) -> int:
    return max(1, min(max_chunks, cdiv(_TARGET_PROGRAMS, num_seqs * num_kv_heads)))


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "windowed", "num_splits",
                                             "interpret"))
def mosaic_paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                        block_tables: jax.Array, context_lens: jax.Array, layer: jax.Array,
                        window: jax.Array | int = 0, kv_scale: jax.Array | None = None, *,
                        scale: float, softcap: float | None = None, windowed: bool = False,
                        num_splits: int | None = None, interpret: bool = False) -> jax.Array:
    """``paged_decode_attention`` in Mosaic GPU. ``window`` is data (0: the whole context)
    read when ``windowed``; ``kv_scale [2, Hkv, D]``: an int8 / FP8 cache's static scales
    (K's multiply the queries before the kernel, V's its output after: `kv_quant`);
    ``interpret``: run in the GPU interpreter (`plgpu.InterpretGPUParams`) on CPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.paged_decode_attention import combine_splits

    k5, v5 = as_5d(k_cache), as_5d(v_cache)
    num_layers, hkv, num_blocks, block_size, d = k5.shape
    num_seqs, hq, _ = q.shape
    group = hq // hkv
    chunk = chunk_tokens(block_size)
    max_chunks = max(1, cdiv(block_tables.shape[1] * block_size, chunk))
    splits = max(1, min(num_splits or decode_splits(num_seqs, hkv, max_chunks), max_chunks))
    per_split = cdiv(max_chunks, splits)
    parts = col_parts(d)  # programs per split, one per V_COLS output columns
    dv = d // parts
    pages = splits * per_split * (chunk // block_size)  # every index a chunk can form
    # Tables and lengths get buffers of their own (`own_buffer`: Mosaic needs aligned inputs).
    tables = own_buffer(block_tables.astype(jnp.int32), max(1, pages - block_tables.shape[1]))
    qg = q.reshape(num_seqs, hkv, group, d)
    if kv_scale is not None:
        qg = scale_channels(qg, kv_scale[0]).astype(q.dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    flat = (num_layers * hkv * num_blocks, block_size, d)
    f32 = jnp.float32
    kernel = functools.partial(_kernel, num_kv_heads=hkv, num_blocks=num_blocks,
                               block_size=block_size, chunks_per_split=per_split,
                               scale=float(scale), softcap=softcap, windowed=windowed)
    acc, m, lsum = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits * parts, num_seqs, hkv, ROWS, dv), f32),
                  jax.ShapeDtypeStruct((splits * parts, num_seqs, hkv, ROWS), f32),
                  jax.ShapeDtypeStruct((splits * parts, num_seqs, hkv, ROWS), f32)),
        scratch_types=(*scratch_types(d, chunk, q.dtype, stats=True, cache_dtype=k5.dtype),
                       *barriers(chunk // block_size)),
        grid=(num_seqs, hkv, splits * parts), grid_names=("seq", "head", "split"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(jnp.stack([jnp.reshape(layer, ()), window_span(window)]).astype(jnp.int32),
      own_buffer(context_lens.astype(jnp.int32)), tables, qg,
      k5.reshape(flat), v5.reshape(flat))
    # Column programs: their tiles side by side; their statistics are equal, take the first.
    acc = jnp.moveaxis(acc.reshape(splits, parts, num_seqs, hkv, ROWS, dv), 1, -2).reshape(
        splits, num_seqs, hkv, ROWS, d)
    m, lsum = m.reshape(splits, parts, *m.shape[1:])[:, 0], lsum.reshape(
        splits, parts, *lsum.shape[1:])[:, 0]
    # The kernel's running max is in base 2: scale it to base e for the shared combine.
    out = combine_splits(acc, m * math.log(2.0), lsum, rows=group)
    if kv_scale is not None:
        out = scale_channels(out, kv_scale[1])
    return out.reshape(num_seqs, hq, d).astype(q.dtype)
