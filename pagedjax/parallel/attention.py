"""Per-shard attention and cache ops: `shard_map` around the paged kernels.

Under tensor parallelism each device owns ``num_heads / N`` query heads and the matching
``Hkv / N`` KV heads of the cache, and attention needs nothing from other devices. Running the
kernels inside `shard_map` hands each one its local view (``q [T, H/N, D]``, cache
``[L, Hkv/N, blocks, bs, D]``) with replicated block tables and slot mappings, so the Pallas
kernels (which XLA's partitioner cannot split) work unchanged, and the XLA reference cannot
be partitioned into an all-gather of the cache by accident.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pagedjax.core.kv_groups import KVGroupLayout
from pagedjax.parallel.mesh import AXIS, CACHE_SPEC
from pagedjax.worker.paged_attention import PagedAttention, PagedMeta
from pallas_kernels import copy_blocks
from pallas_kernels._common import has_window

HEADS = P(None, AXIS, None)  # [T, heads, D]


@dataclasses.dataclass(frozen=True)
class ShardedPagedAttention:
    """`PagedAttention` run per shard: same signature, so the model does not change."""

    mesh: Mesh
    backend: str | None = None
    layout: KVGroupLayout | None = None
    token_scales: bool = False  # factor slots shard on the head axis like the values

    def __call__(self, q, k, v, kv_cache, layer, meta: PagedMeta, *, scale: float | None = None,
                 window=0, softcap: float | None = None):
        inner = PagedAttention(self.backend, self.layout, self.token_scales)
        windowed = has_window(window)  # else the kernels keep their window-free variant

        def local(q, k, v, k_cache, v_cache, layer, w, meta):
            out, (k_cache, v_cache) = inner(q, k, v, (k_cache, v_cache), layer, meta,
                                            scale=scale, window=w if windowed else 0,
                                            softcap=softcap)
            return out, k_cache, v_cache

        meta_spec = jax.tree.map(lambda _: P(), meta)
        if meta.kv_scales is not None:  # [layers, K/V, Hkv, D]: each shard its heads' scales
            meta_spec = dataclasses.replace(meta_spec, kv_scales=P(None, None, AXIS, None))
        fn = jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(HEADS, HEADS, HEADS, CACHE_SPEC, CACHE_SPEC, P(), P(), meta_spec),
            out_specs=(HEADS, CACHE_SPEC, CACHE_SPEC), check_vma=False)
        out, k_cache, v_cache = fn(q, k, v, kv_cache[0], kv_cache[1], layer,
                                   jnp.asarray(window if windowed else 0, jnp.int32), meta)
        return out, (k_cache, v_cache)


def sharded_copy_blocks(mesh: Mesh, k_cache, v_cache, mapping, backend: str | None):
    """Copy-on-write block copies on every shard's heads (the mapping is replicated)."""
    fn = jax.shard_map(
        lambda k, v, m: copy_blocks(k, v, m, backend=backend), mesh=mesh,
        in_specs=(CACHE_SPEC, CACHE_SPEC, P()), out_specs=(CACHE_SPEC, CACHE_SPEC),
        check_vma=False)
    return fn(k_cache, v_cache, mapping)
