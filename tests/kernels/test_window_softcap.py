"""Sliding-window attention and logit soft-capping in every attention backend.

Each case runs the ragged kernel (mixed prefill chunks and decodes) and the decode kernel
against a float64 numpy reference that applies the window and the cap per query. Poisoning
models what a windowed KV manager does: blocks wholly before a sequence's first visible
position are freed, so their table entries become junk ids (possibly another sequence's
live block) and every slot before the window holds NaN or a huge value. The outputs must
equal the clean run exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode_attention, ragged_paged_attention

from ._paged import DTYPES, TOL, make_paged, np_dtype
from .test_ragged import np_ragged

# (sequences as (q_len, kv_len), group, head_dim, block_size, dtype, num_kv_heads, window,
# softcap). kv_len includes the new tokens.
CASES = [
    ([(1, 100), (20, 70), (1, 5)], 2, 64, 16, "float32", 2, 24, None),
    ([(1, 33), (9, 40), (8, 8)], 1, 128, 8, "bfloat16", 2, 1, 5.0),  # window 1: itself only
    ([(33, 90), (1, 64)], 4, 64, 32, "float32", 1, 17, 2.0),  # window not a block multiple
    ([(5, 300), (1, 260)], 2, 64, 64, "float16", 2, 100, None),
    ([(1, 31), (12, 12)], 3, 128, 16, "float32", 1, 4096, 30.0),  # window wider than context
    ([(40, 200)], 8, 64, 8, "bfloat16", 1, 0, 3.0),  # no window, soft-cap only
    # In the Mosaic GPU kernels' scope (bf16/fp16, head dim 64/128, pages 16-128) as well:
    ([(1, 100), (20, 70), (1, 5)], 2, 64, 16, "bfloat16", 2, 24, None),
    ([(33, 90), (1, 64)], 4, 128, 32, "float16", 1, 17, 2.0),
    ([(5, 300), (70, 260)], 1, 64, 64, "bfloat16", 1, 100, 30.0),
    ([(40, 200)], 8, 64, 16, "bfloat16", 1, 0, 3.0),
]
MOSAIC_CASES = range(len(CASES) - 4, len(CASES))
PAD_TOKENS = 3
PAD_SEQS = 1


def build(idx):
    seqs, group, head_dim, bs, dtype, hkv, window, softcap = CASES[idx]
    rng = np.random.default_rng(7000 + idx)
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=2, num_kv_heads=hkv,
                    block_size=bs, head_dim=head_dim, dtype=dtype)
    n = len(seqs)
    q_lens = [ql for ql, _ in seqs]
    cu = np.zeros(n + PAD_SEQS + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.concatenate([pc.ctx_lens, rng.integers(1, 300, PAD_SEQS)]).astype(np.int32)
    junk = rng.integers(-5, 10_000, (PAD_SEQS, pc.block_tables.shape[1]))
    tables = np.concatenate([pc.block_tables, junk]).astype(np.int32)
    q = rng.standard_normal((sum(q_lens) + PAD_TOKENS, hkv * group, head_dim)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, DTYPES[dtype]))

    # Out-of-window state: freed blocks' entries become junk, slots before the window poison.
    freed_tables = tables.copy()
    k_bad, v_bad = pc.k_poison.copy(), pc.v_poison.copy()
    num_blocks = pc.k_clean.shape[2]
    dt = np_dtype(dtype)
    for s, (q_len, kv_len) in enumerate(seqs):
        lo = max(0, kv_len - q_len - window + 1) if window else 0
        for t in range(lo):
            blk = tables[s, t // bs]
            k_bad[:, :, blk, t % bs] = np.asarray(np.nan, dt)
            v_bad[:, :, blk, t % bs] = np.asarray(np.nan, dt)
        for p in range(lo // bs):
            freed_tables[s, p] = rng.integers(-3, num_blocks + 50)
    return seqs, head_dim, dtype, window, softcap, pc, q, cu, kv_lens, tables, freed_tables, \
        k_bad, v_bad


def _mosaic(monkeypatch):
    """Route the Pallas backend to the Mosaic GPU kernels (interpreted on CPU)."""
    from pallas_kernels import mosaic_decode_attention as mdec
    from pallas_kernels.backend import ENV_LOWERING, interpret_mode

    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic kernels issue wgmma: Hopper (sm_90) only")
    monkeypatch.setenv(ENV_LOWERING, "mosaic")
    return "pallas"


@pytest.mark.parametrize("idx", MOSAIC_CASES)
def test_mosaic_ragged_window_softcap(idx, monkeypatch):
    test_ragged_window_softcap(idx, _mosaic(monkeypatch))


@pytest.mark.parametrize("idx", MOSAIC_CASES)
def test_mosaic_decode_window_softcap(idx, monkeypatch):
    test_decode_window_softcap(idx, _mosaic(monkeypatch))


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_ragged_window_softcap(idx, backend):
    (seqs, head_dim, dtype, window, softcap, pc, q, cu, kv_lens, tables, freed, k_bad,
     v_bad) = build(idx)
    scale = head_dim ** -0.5
    expect = np_ragged(q, pc.k_clean, pc.v_clean, 1, tables, seqs, cu, scale, window, softcap)

    def run(k, v, t):
        out = ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens), jnp.asarray(t),
            jnp.asarray(cu), jnp.int32(len(seqs)), scale=scale, layer=1, window=window,
            softcap=softcap, backend=backend)
        return np.asarray(out.astype(jnp.float32))

    clean = run(pc.k_clean, pc.v_clean, tables)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    poisoned = run(k_bad, v_bad, freed)
    np.testing.assert_array_equal(poisoned, clean)
    np.testing.assert_array_equal(poisoned[-PAD_TOKENS:], 0.0)


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_decode_window_softcap(idx, backend):
    """The decode kernel on the last token of every sequence (its own launch shape)."""
    (seqs, head_dim, dtype, window, softcap, pc, q, cu, kv_lens, tables, freed, k_bad,
     v_bad) = build(idx)
    n = len(seqs)
    scale = head_dim ** -0.5
    rows = np.asarray([cu[s + 1] - 1 for s in range(n)])
    qd = q[rows]
    dec = [(1, kv) for _, kv in seqs]
    expect = np_ragged(qd, pc.k_clean, pc.v_clean, 0, tables, dec, np.arange(n + 1), scale,
                         window, softcap)
    # A query at the end of its context sees less than the first query of a chunk did, so the
    # ragged case's freed blocks are also out of this query's window.

    def run(k, v, t):
        out = paged_decode_attention(
            jnp.asarray(qd), jnp.asarray(k), jnp.asarray(v), jnp.asarray(t[:n]),
            jnp.asarray(kv_lens[:n]), scale=scale, layer=0, window=window, softcap=softcap,
            backend=backend)
        return np.asarray(out.astype(jnp.float32))

    clean = run(pc.k_clean, pc.v_clean, tables)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    np.testing.assert_array_equal(run(k_bad, v_bad, freed), clean)


def test_traced_window_matches_static():
    """The model passes each layer's window as data under the layer scan."""
    import jax

    seqs, head_dim, dtype, window, softcap, pc, q, cu, kv_lens, tables, *_ = build(0)
    args = (jnp.asarray(q), jnp.asarray(pc.k_clean), jnp.asarray(pc.v_clean),
            jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs)))

    @jax.jit
    def traced(w, *a):
        return ragged_paged_attention(*a, scale=head_dim ** -0.5, layer=1, window=w,
                                      backend="xla")

    static = ragged_paged_attention(*args, scale=head_dim ** -0.5, layer=1, window=window,
                                    backend="xla")
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(window), *args)), np.asarray(static))
    full = ragged_paged_attention(*args, scale=head_dim ** -0.5, layer=1, backend="xla")
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(0), *args)), np.asarray(full))
    assert not np.array_equal(np.asarray(full), np.asarray(static))
