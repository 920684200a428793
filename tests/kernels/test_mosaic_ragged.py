"""The Mosaic GPU ragged paged attention kernel (prefill chunks, whole prompts and decode
rows in one launch), in jax's GPU interpreter on CPU (compiled on a lent Hopper GPU),
against the float64 numpy reference, with poisoned blocks, page tails and junk padding
slots; its selection behind ``ragged_paged_attention`` (PAGEDJAX_PALLAS_LOWERING=mosaic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_decode_attention as mdec
from pallas_kernels import mosaic_ragged_attention as mrag
from pallas_kernels import ragged_paged_attention
from pallas_kernels.backend import ENV_LOWERING, interpret_mode

from ._paged import DTYPES, TOL, make_paged
from .test_ragged import np_ragged

# (sequences as (q_len, kv_len), group, head_dim, block_size, dtype, num_kv_heads): decode
# rows, chunks continuing a cached prefix, whole prompts, items split at 64 / G tokens
# (G = 1: 64 tokens, G = 3 -> 4: 16), lengths around pages and the 64-token chunk.
CASES = [
    ([(1, 30), (5, 5), (20, 70)], 2, 64, 16, "bfloat16", 1),
    ([(33, 40), (1, 90), (1, 17)], 4, 128, 32, "float16", 2),
    ([(70, 200), (1, 1)], 1, 64, 64, "bfloat16", 1),
    ([(10, 10), (7, 100)], 3, 64, 128, "bfloat16", 1),
    ([(17, 65), (64, 64), (1, 63)], 8, 128, 16, "bfloat16", 1),
    # head dim 256: two column programs per (item, head), each gathering its half of V
    ([(9, 80), (1, 33), (40, 40)], 2, 256, 16, "bfloat16", 2),
]
PAD_TOKENS, PAD_SEQS = 3, 2


def _build(idx):
    seqs, group, d, bs, dtype, hkv = CASES[idx]
    rng = np.random.default_rng(5000 + idx)
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=2, num_kv_heads=hkv,
                    block_size=bs, head_dim=d, dtype=dtype, share_prefix=len(seqs) > 1)
    n = len(seqs)
    cu = np.zeros(n + PAD_SEQS + 1, np.int32)
    cu[1:n + 1] = np.cumsum([ql for ql, _ in seqs])
    cu[n + 1:] = cu[n]
    kv_lens = np.concatenate([pc.ctx_lens, rng.integers(1, 500, PAD_SEQS)]).astype(np.int32)
    junk = rng.integers(-5, 10_000, (PAD_SEQS, pc.block_tables.shape[1]))
    tables = np.concatenate([pc.block_tables, junk]).astype(np.int32)
    q = rng.standard_normal((int(cu[n]) + PAD_TOKENS, hkv * group, d)).astype(np.float32)
    return seqs, d, dtype, pc, np.asarray(jnp.asarray(q, DTYPES[dtype])), cu, kv_lens, tables


def _skip_off_hopper():
    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic kernels issue wgmma: Hopper (sm_90) only")


def _call(q, k, v, kv_lens, tables, cu, num_seqs, scale, layer):
    out = mrag.mosaic_ragged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens),
        jnp.asarray(tables), jnp.asarray(cu), jnp.int32(num_seqs), jnp.int32(layer),
        scale=scale, interpret=interpret_mode())
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_mosaic_ragged_matches_reference_and_ignores_poison(idx):
    _skip_off_hopper()
    seqs, d, dtype, pc, q, cu, kv_lens, tables = _build(idx)
    scale, layer = d ** -0.5, 1
    expect = np_ragged(q, pc.k_clean, pc.v_clean, layer, tables, seqs, cu, scale)
    common = (kv_lens, tables, cu, len(seqs), scale, layer)
    clean = _call(q, pc.k_clean, pc.v_clean, *common)
    poisoned = _call(q, pc.k_poison, pc.v_poison, *common)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    np.testing.assert_array_equal(poisoned, clean)
    np.testing.assert_array_equal(poisoned[-PAD_TOKENS:], 0.0)


def test_inputs_sliced_from_one_packed_array():
    """As the runner passes them: lengths, tables and query starts sliced out of one packed
    int array inside the jit (views XLA may hand on unaligned, which Mosaic rejects: the
    whole-model step on the H200, stop 52). The kernel's own copies (`own_buffer`) change
    nothing; test_mosaic_decode's `test_index_inputs_are_own_buffers` checks they exist."""
    _skip_off_hopper()
    seqs, d, dtype, pc, q, cu, kv_lens, tables = _build(1)
    direct = _call(q, pc.k_poison, pc.v_poison, kv_lens, tables, cu, len(seqs), 0.1, 1)
    parts = [np.arange(3, dtype=np.int32), kv_lens, tables.ravel(), cu]
    packed = np.concatenate(parts).astype(np.int32)
    at = np.cumsum([0] + [p.size for p in parts])

    @jax.jit
    def step(packed, q, k, v):
        lens_ = packed[at[1]:at[2]]
        tables_ = packed[at[2]:at[3]].reshape(tables.shape)
        cu_ = packed[at[3]:at[4]]
        return mrag.mosaic_ragged_attention(q, k, v, lens_, tables_, cu_, jnp.int32(len(seqs)),
                                            jnp.int32(1), scale=0.1,
                                            interpret=interpret_mode())

    out = step(jnp.asarray(packed), jnp.asarray(q), jnp.asarray(pc.k_poison),
               jnp.asarray(pc.v_poison))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), direct)


def test_no_live_sequences_gives_zeros():
    _skip_off_hopper()
    seqs, d, _, pc, q, cu, kv_lens, tables = _build(0)
    np.testing.assert_array_equal(_call(q, pc.k_poison, pc.v_poison, kv_lens, tables, cu, 0,
                                        0.1, 0), 0.0)


def test_selected_by_lowering(monkeypatch):
    """PAGEDJAX_PALLAS_LOWERING=mosaic routes ragged calls the kernel covers to it, windowed
    and soft-capped ones included; results agree with Triton's."""
    _skip_off_hopper()
    seqs, d, dtype, pc, q, cu, kv_lens, tables = _build(0)
    calls = []
    real = mrag.mosaic_ragged_attention
    monkeypatch.setattr(mrag, "mosaic_ragged_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    args = (jnp.asarray(q), jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison),
            jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs)))
    outs = {}
    for lowering in ("mosaic", "triton"):
        monkeypatch.setenv(ENV_LOWERING, lowering)
        outs[lowering] = [np.asarray(ragged_paged_attention(
            *args, scale=0.125, layer=0, backend="pallas", **kw), np.float32)
            for kw in ({}, {"window": 8}, {"softcap": 5.0})]
        assert len(calls) == 3
    for m, t in zip(outs["mosaic"], outs["triton"], strict=True):
        np.testing.assert_allclose(m, t, atol=TOL[dtype], rtol=0)
