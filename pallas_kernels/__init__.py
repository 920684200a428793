"""Pallas kernels for the paged KV cache (PagedAttention in JAX).

Cache layout: K and V are separate arrays, stacked over layers and head-major,
``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``. Why:

* each (KV head, block) tile ``[block_size, head_dim]`` is contiguous, so a GPU program
  reads a whole block with one coalesced load (and the layout matches jax's upstream
  Pallas paged-attention kernel, which keeps benchmark comparisons apples-to-apples);
* the KV-head axis (1) is the axis tensor parallelism shards, so every device holds whole
  blocks of its own heads;
* stacking layers lets the model ``lax.scan`` over layers with the cache as a loop carry,
  updated in place; every function takes ``layer`` as a python int or traced int32 scalar.

A 4-D cache ``[num_kv_heads, num_blocks, block_size, head_dim]`` is accepted as one layer.
The slot of a token is ``physical_block * block_size + offset``.

Each public function takes ``backend``: "pallas" (Triton-lowered on GPU, interpreted on
CPU), "xla" (the pure-jnp reference beside each kernel) or None (auto: Pallas on GPU, XLA
on CPU); ``PAGEDJAX_ATTENTION_BACKEND`` overrides the automatic choice. The Triton
specifics (compiler params, power-of-two tiles) live inside each ``*_pallas`` function so a
Mosaic GPU variant can be added beside it behind the same entry points.
"""

from pallas_kernels.backend import resolve_backend
from pallas_kernels.copy_blocks import copy_blocks, copy_blocks_ref
from pallas_kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_ref,
)
from pallas_kernels.swap import swap_in, swap_out
from pallas_kernels.write_kv import write_kv, write_kv_ref

__all__ = [
    "copy_blocks",
    "copy_blocks_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "ragged_paged_attention",
    "ragged_paged_attention_ref",
    "resolve_backend",
    "swap_in",
    "swap_out",
    "write_kv",
    "write_kv_ref",
]
