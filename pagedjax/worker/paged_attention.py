"""The model's `AttentionFn` for the paged cache: write this step's K/V, then attend.

The cache is `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` (see
`pallas_kernels`); the model scans over layers and passes the traced layer index through.
A hybrid model's cache is `[group_size, ...]` instead (`pagedjax.core.kv_groups`): layer l
reads and writes slot `slot_of_layer[l]` through block table `group_of_layer[l]` of the
step's `[G, S, M]` tables (and slot mapping `[G, T]`); the kernels see one layer and one table
as always.
Pure-decode steps use `paged_decode_attention` (one query per sequence, split-K over the
context); steps with any prefill chunk use `ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pagedjax.core.kv_groups import KVGroupLayout
from pallas_kernels import paged_decode_attention, ragged_paged_attention, write_kv


@dataclasses.dataclass(frozen=True)
class PagedMeta:
    """Per-step metadata, built on the host by `StepInputs` (all int32).

    slot_mapping [T] ([G, T] hybrid): cache slot of each query token (-1: padding, not written).
    kv_lens [S]: context length of each sequence including this step's tokens (0: padding).
    block_tables [S, M] ([G, S, M] hybrid): physical block ids per sequence.
    cu_q_lens [S+1]: cumulative query lengths (ragged layout of the T tokens).
    num_seqs []: number of real sequences.
    kv_scales [num_layers, 2, Hkv, D] float32: static scales of a quantized (int8 / FP8)
      cache, per model layer, K then V (`pallas_kernels.kv_quant`); None for a float cache. Device
      resident: the runner adds it to every step (`ModelRunner.kv_scales`).
    decode_only: static; True when every sequence has exactly one query token (T == S).
    """

    slot_mapping: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    decode_only: bool = False
    kv_scales: jax.Array | None = None


jax.tree_util.register_dataclass(
    PagedMeta, data_fields=["slot_mapping", "kv_lens", "block_tables", "cu_q_lens", "num_seqs",
                            "kv_scales"],
    meta_fields=["decode_only"])


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    backend: str | None = None
    layout: KVGroupLayout | None = None  # hybrid models only
    # The cache keeps per-token factors in extra slots after its data slots
    # (`pallas_kernels.kv_quant`, granularity "per_token"); the kernels see cache slots.
    token_scales: bool = False

    def __call__(self, q, k, v, kv_cache, layer, meta: PagedMeta, *, scale: float | None = None,
                 window=0, softcap: float | None = None):
        k_cache, v_cache = kv_cache
        tables, slots = meta.block_tables, meta.slot_mapping
        # A quantized cache's scales belong to the model layer (before the hybrid layout maps
        # it onto a cache slot shared by layers of several groups).
        kv_scale = None if meta.kv_scales is None else meta.kv_scales[layer]
        if self.layout is not None and self.layout.hybrid:
            group = jnp.asarray(self.layout.group_of_layer, jnp.int32)[layer]
            layer = jnp.asarray(self.layout.slot_of_layer, jnp.int32)[layer]
            tables, slots = tables[group], slots[group]
        k_cache, v_cache = write_kv(k, v, k_cache, v_cache, slots, layer=layer,
                                    backend=self.backend, kv_scale=kv_scale,
                                    token_scales=self.token_scales)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if meta.decode_only:
            out = paged_decode_attention(q, k_cache, v_cache, tables, meta.kv_lens,
                                         scale=scale, layer=layer, window=window,
                                         softcap=softcap, backend=self.backend,
                                         kv_scale=kv_scale, token_scales=self.token_scales)
        else:
            out = ragged_paged_attention(q, k_cache, v_cache, meta.kv_lens, tables,
                                         meta.cu_q_lens, meta.num_seqs, scale=scale, layer=layer,
                                         window=window, softcap=softcap, backend=self.backend,
                                         kv_scale=kv_scale, token_scales=self.token_scales)
        return out, (k_cache, v_cache)
