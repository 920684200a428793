"""ragged_paged_attention on mixed decode + prefill-chunk batches vs dense numpy attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention

from ._paged import DTYPES, TOL, dense_kv, make_paged

# (sequences as (q_len, kv_len), group, head_dim, block_size, dtype, num_kv_heads).
# Sequence 1 shares sequence 0's full blocks, so a prefill chunk's prefix lives in blocks
# another sequence also points at. kv_len includes the new tokens.
CASES = [
    ([(1, 1100), (40, 70), (1, 1), (17, 17)], 3, 64, 16, "bfloat16", 3),
    ([(1, 9), (9, 16), (8, 8)], 1, 128, 8, "float32", 2),
    ([(33, 33), (1, 32), (5, 1030)], 4, 64, 32, "float16", 2),
    ([(1, 15), (20, 50)], 8, 128, 16, "float32", 1),
    ([(1, 31)], 3, 128, 32, "bfloat16", 1),
    ([(64, 200)], 4, 64, 8, "float32", 2),
    # Pages at or above the KV chunk size: whole-page and sub-page chunks.
    ([(1, 300), (20, 140)], 2, 64, 64, "bfloat16", 2),
    ([(30, 290), (1, 5)], 4, 64, 256, "float32", 1),
    ([(1, 200)], 1, 128, 128, "float16", 2),
]
PAD_TOKENS = 5
PAD_SEQS = 2


def np_ragged(q, k_cache, v_cache, layer, tables, seqs, cu, scale, window=0, softcap=None):
    """Dense causal attention, one query token at a time, in float64; a query at position p
    sees ``(p - window, p]`` when ``window`` is positive, and logits are soft-capped when
    ``softcap`` is given."""
    out = np.zeros(q.shape, np.float64)
    hq, hkv = q.shape[1], k_cache.shape[1]
    for s, (q_len, kv_len) in enumerate(seqs):
        k = dense_kv(k_cache, layer, tables[s], kv_len)
        v = dense_kv(v_cache, layer, tables[s], kv_len)
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(hq):
                kh = h // (hq // hkv)
                logits = k[kh, lo : pos + 1] @ q[cu[s] + i, h].astype(np.float64) * scale
                if softcap:
                    logits = softcap * np.tanh(logits / softcap)
                p = np.exp(logits - logits.max())
                out[cu[s] + i, h] = (p / p.sum()) @ v[kh, lo : pos + 1]
    return out


def _build(idx):
    seqs, group, head_dim, bs, dtype, hkv = CASES[idx]
    rng = np.random.default_rng(2000 + idx)
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=2, num_kv_heads=hkv,
                    block_size=bs, head_dim=head_dim, dtype=dtype,
                    share_prefix=len(seqs) > 1)
    n = len(seqs)
    q_lens = [ql for ql, _ in seqs]
    num_tokens = sum(q_lens) + PAD_TOKENS
    cu = np.zeros(n + PAD_SEQS + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    # Padding sequence slots carry junk lengths and tables: they must be ignored.
    kv_lens = np.concatenate([pc.ctx_lens, rng.integers(1, 500, PAD_SEQS)]).astype(np.int32)
    junk = rng.integers(-5, 10_000, (PAD_SEQS, pc.block_tables.shape[1]))
    tables = np.concatenate([pc.block_tables, junk]).astype(np.int32)
    q = rng.standard_normal((num_tokens, hkv * group, head_dim)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, DTYPES[dtype]))
    return seqs, head_dim, dtype, pc, q, cu, kv_lens, tables


def _run(q, k, v, kv_lens, tables, cu, num_seqs, scale, layer, backend, **kw):
    out = ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens),
        jnp.asarray(tables), jnp.asarray(cu), jnp.int32(num_seqs), scale=scale,
        layer=layer, backend=backend, **kw,
    )
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_ragged_matches_dense_causal_reference(idx, backend):
    seqs, head_dim, dtype, pc, q, cu, kv_lens, tables = _build(idx)
    scale = head_dim**-0.5
    layer = 1
    expect = np_ragged(q, pc.k_clean, pc.v_clean, layer, tables, seqs, cu, scale)
    common = (kv_lens, tables, cu, len(seqs), scale, layer, backend)
    clean = _run(q, pc.k_clean, pc.v_clean, *common)
    poisoned = _run(q, pc.k_poison, pc.v_poison, *common)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    np.testing.assert_array_equal(poisoned, clean)
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned[-PAD_TOKENS:], 0.0)


@pytest.mark.parametrize("block_q", [4, 8, 32])
def test_ragged_block_q_agree(block_q):
    seqs, head_dim, dtype, pc, q, cu, kv_lens, tables = _build(0)
    common = (kv_lens, tables, cu, len(seqs), head_dim**-0.5, 0)
    ref = _run(q, pc.k_poison, pc.v_poison, *common, "xla")
    out = _run(q, pc.k_poison, pc.v_poison, *common, "pallas", block_q=block_q)
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("chunk_tokens", [16, 32, 128])
def test_ragged_chunk_sizes_agree(chunk_tokens):
    seqs, head_dim, dtype, pc, q, cu, kv_lens, tables = _build(2)  # block size 32
    common = (kv_lens, tables, cu, len(seqs), head_dim**-0.5, 0)
    ref = _run(q, pc.k_poison, pc.v_poison, *common, "xla")
    out = _run(q, pc.k_poison, pc.v_poison, *common, "pallas", chunk_tokens=chunk_tokens)
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=0)


def test_ragged_no_live_sequences_gives_zeros():
    seqs, head_dim, _, pc, q, cu, kv_lens, tables = _build(1)
    out = _run(q, pc.k_poison, pc.v_poison, kv_lens, tables, cu, 0, 0.1, 0, "pallas")
    np.testing.assert_array_equal(out, 0.0)


def test_ragged_traced_layer():
    seqs, head_dim, dtype, pc, q, cu, kv_lens, tables = _build(3)
    k, v = jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison)

    @jax.jit
    def at_layer(layer):
        return ragged_paged_attention(
            jnp.asarray(q), k, v, jnp.asarray(kv_lens), jnp.asarray(tables),
            jnp.asarray(cu), jnp.int32(len(seqs)), scale=0.1, layer=layer, backend="pallas")

    for layer in range(2):
        ref = _run(q, pc.k_poison[layer], pc.v_poison[layer], kv_lens, tables, cu,
                   len(seqs), 0.1, None, "pallas")
        np.testing.assert_array_equal(np.asarray(at_layer(jnp.int32(layer))), ref)


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_xla_per_token_and_item_formulations_match_dense(idx):
    """The XLA (CPU) path has two formulations, picked by step size: one decode query per
    token for small steps (`ragged_paged_attention_per_token`) and work items of query rows
    for large ones (`ragged_paged_attention_ref`). Both equal dense attention on every case,
    and neither reads a poisoned slot or writes a padding row."""
    from pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention_per_token,
        ragged_paged_attention_ref,
    )

    seqs, head_dim, dtype, pc, q, cu, kv_lens, tables = _build(idx)
    scale = head_dim**-0.5
    expect = np_ragged(q, pc.k_clean, pc.v_clean, 1, tables, seqs, cu, scale)
    for fn in (ragged_paged_attention_per_token, ragged_paged_attention_ref):
        out = fn(jnp.asarray(q), jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison),
                 jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
                 jnp.int32(len(seqs)), jnp.int32(1), scale=scale)
        out = np.asarray(out.astype(jnp.float32))
        np.testing.assert_allclose(out, expect, atol=TOL[dtype], rtol=0, err_msg=fn.__name__)
        np.testing.assert_array_equal(out[-PAD_TOKENS:], 0.0)
