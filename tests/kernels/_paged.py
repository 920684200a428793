"""Test fixtures: random paged caches with poisoned unused memory, and numpy references.

The references here are written independently of the module's own jnp references: they
walk each sequence in float64 numpy, one query at a time.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Max abs error vs the float64 reference. bf16 keeps 8 mantissa bits; the kernel also
# rounds probabilities to the value dtype before the PV product, as flash attention does.
TOL = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class PagedCase:
    k_clean: np.ndarray  # [L, Hkv, NB, bs, D], unused memory finite random
    v_clean: np.ndarray
    k_poison: np.ndarray  # same, unused blocks / tail slots NaN or huge
    v_poison: np.ndarray
    block_tables: np.ndarray  # [S, max_pages], padding entries are junk ids
    ctx_lens: np.ndarray  # [S]


def make_paged(
    rng: np.random.Generator,
    *,
    ctx_lens: list[int],
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: str,
    share_prefix: bool = False,
    extra_pages: int = 2,
    spare_blocks: int = 5,
) -> PagedCase:
    """Random cache whose blocks are handed out in a random permutation.

    With ``share_prefix`` sequence 1 points at sequence 0's full blocks for its prefix, so
    two block-table rows reference the same physical blocks.
    """
    pages = [cdiv(c, block_size) for c in ctx_lens]
    max_pages = max(max(pages), 1) + extra_pages
    shared = 0
    if share_prefix and len(ctx_lens) > 1:
        shared = min(ctx_lens[0] // block_size, pages[1])
    need = sum(pages) - shared
    num_blocks = need + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = rng.integers(-3, num_blocks + 50, size=(len(ctx_lens), max_pages)).astype(np.int32)
    nxt = 0
    for s, n in enumerate(pages):
        for p in range(n):
            if s == 1 and p < shared:
                tables[s, p] = tables[0, p]
            else:
                tables[s, p] = perm[nxt]
                nxt += 1
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    dt = np_dtype(dtype)
    k = rng.standard_normal(shape).astype(np.float32).astype(dt)
    v = rng.standard_normal(shape).astype(np.float32).astype(dt)
    kp, vp = k.copy(), v.copy()
    used = np.zeros((num_blocks, block_size), bool)
    for s, c in enumerate(ctx_lens):
        for t in range(c):
            used[tables[s, t // block_size], t % block_size] = True
    huge = float(np.finfo(dt).max) if dt != np.dtype(ml_dtypes.bfloat16) else 3e38
    poison = np.where(rng.random(used.shape) < 0.5, np.nan, huge).astype(np.float32)
    for arr in (kp, vp):
        arr[:, :, ~used] = poison[~used][:, None].astype(dt)
    return PagedCase(k, v, kp, vp, tables, np.asarray(ctx_lens, np.int32))


def dense_kv(cache: np.ndarray, layer: int, table: np.ndarray, length: int) -> np.ndarray:
    """``[Hkv, length, D]`` float64 K or V of one sequence, gathered through its table."""
    bs = cache.shape[3]
    pages = [int(table[t // bs]) for t in range(0, length, bs)]
    if not pages:
        return np.zeros((cache.shape[1], 0, cache.shape[4]))
    blocks = cache[layer][:, pages].astype(np.float64)  # [Hkv, n, bs, D]
    return blocks.reshape(cache.shape[1], -1, cache.shape[4])[:, :length]


def np_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """One query token ``[Hq, D]`` against ``[Hkv, T, D]`` (GQA by head groups)."""
    hq, hkv = q.shape[0], k.shape[0]
    out = np.zeros(q.shape, np.float64)
    if k.shape[1] == 0:
        return out
    for h in range(hq):
        kh = h // (hq // hkv)
        logits = k[kh] @ q[h].astype(np.float64) * scale
        p = np.exp(logits - logits.max())
        out[h] = (p / p.sum()) @ v[kh]
    return out
