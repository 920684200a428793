"""Quantized KV caches (`pallas_kernels.kv_quant`): int8 and FP8 (e4m3, e5m2) storage with
static per-(layer, KV head, channel) scales.

Every attention backend (Pallas interpreted, XLA, native CPU) against a float64 numpy
reference computed on the dequantized values (``stored * scale``: the same numbers, so float
error only), and against full-precision attention within the quantization error; unused and
stale slots hold bytes that decode to NaN (FP8) or junk (int8) and must never be read.
write_kv's stored bytes equal numpy's quantization exactly; block copies and swaps move the
quantized bytes unchanged."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import (
    copy_blocks,
    paged_decode_attention,
    ragged_paged_attention,
    swap_in,
    swap_out,
    write_kv,
)
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, qmax, scales_from_amax

from ._paged import make_paged
from .test_ragged import np_ragged

NP_DTYPES = {"int8": np.dtype(np.int8), "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
             "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
# Relative Frobenius error of attention outputs against full precision, per storage format
# (measured at most 2.9 % / 10 % / 23 % over these cases and layers, whose outlier key
# channels sharpen the softmax: e4m3 keeps 3 mantissa bits, e5m2 2; 1.5x headroom).
QUANT_ERR = {"int8": 0.045, "fp8_e4m3": 0.15, "fp8_e5m2": 0.35}
BACKENDS = ["pallas", "xla", "cpu"]
# (sequences as (q_len, kv_len), group, head_dim, block_size, num_kv_heads)
CASES = [
    ([(1, 70), (12, 40), (1, 1), (5, 5)], 3, 64, 16, 2),
    ([(1, 130), (30, 90)], 2, 128, 32, 1),
    ([(7, 260), (1, 17)], 4, 64, 64, 2),
]


def _np_quantize(x: np.ndarray, s: np.ndarray, name: str) -> np.ndarray:
    """Independent quantization: ``x / s`` to the storage format (saturating)."""
    y = x.astype(np.float64) / s
    m = qmax(KV_CACHE_DTYPES[name])
    if name == "int8":
        return np.clip(np.rint(y), -m, m).astype(np.int8)
    return np.clip(y, -m, m).astype(np.float32).astype(NP_DTYPES[name])


def _poison_bytes(n: int, name: str, rng) -> np.ndarray:
    """Bytes for slots no table names: NaN encodings for FP8, junk for int8."""
    if name == "int8":
        return rng.integers(-128, 128, n).astype(np.int8)
    nan = 0x7F if name == "fp8_e4m3" else 0x7E  # e4m3fn S.1111.111, e5m2 S.11111.10
    return (np.full(n, nan, np.uint8) | (rng.integers(0, 2, n, dtype=np.uint8) << 7)) \
        .view(NP_DTYPES[name])


def _quantized_case(idx: int, name: str):
    seqs, group, head_dim, bs, hkv = CASES[idx]
    rng = np.random.default_rng(700 + idx)
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=2, num_kv_heads=hkv,
                    block_size=bs, head_dim=head_dim, dtype="float32", share_prefix=True)
    # Heads and channels of different magnitudes, as in real models (outlier channels).
    mag = rng.uniform(0.5, 4.0, (2, 2, hkv, head_dim)).astype(np.float32)  # [L, K/V, H, D]
    mag[:, 0, :, ::16] *= 8
    k = pc.k_clean * mag[:, 0, :, None, None, :]
    v = pc.v_clean * mag[:, 1, :, None, None, :]
    amax = np.stack([np.abs(k).max(axis=(2, 3)), np.abs(v).max(axis=(2, 3))], axis=1)
    scales = scales_from_amax(amax, KV_CACHE_DTYPES[name])  # [layer, 2, Hkv, D]
    kq = _np_quantize(k, scales[:, 0, :, None, None, :], name)
    vq = _np_quantize(v, scales[:, 1, :, None, None, :], name)
    used = np.zeros(kq.shape[2:4], bool)
    for s, (_, kv) in enumerate(seqs):
        for t in range(kv):
            used[pc.block_tables[s, t // bs], t % bs] = True
    for arr in (kq, vq):  # poison every slot no sequence owns
        flat = arr.reshape(arr.shape[0], arr.shape[1], -1, head_dim)
        idx_unused = np.flatnonzero(~used.reshape(-1))
        junk = _poison_bytes(flat.shape[0] * flat.shape[1] * len(idx_unused) * head_dim,
                             name, rng)
        flat[:, :, idx_unused] = junk.reshape(flat.shape[0], flat.shape[1], -1, head_dim)
    deq_k = kq.astype(np.float64) * scales[:, 0, :, None, None, :]
    deq_v = vq.astype(np.float64) * scales[:, 1, :, None, None, :]
    q_lens = [ql for ql, _ in seqs]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], hkv * group, head_dim)).astype(np.float32)
    return seqs, pc, q, cu, kq, vq, deq_k, deq_v, k, v, scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(NP_DTYPES))
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_ragged_reads_quantized_cache(idx, name, backend):
    seqs, pc, q, cu, kq, vq, deq_k, deq_v, k, v, scales = _quantized_case(idx, name)
    scale = q.shape[-1] ** -0.5
    kv_lens = np.asarray([kv for _, kv in seqs], np.int32)
    for layer in (0, 1):
        got = np.asarray(ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(kv_lens),
            jnp.asarray(pc.block_tables), jnp.asarray(cu), jnp.int32(len(seqs)), scale=scale,
            layer=layer, backend=backend, kv_scale=jnp.asarray(scales[layer])),
            np.float64)
        want = np_ragged(q, deq_k, deq_v, layer, pc.block_tables, seqs, cu, scale)
        assert np.isfinite(got).all(), (name, backend)  # no poisoned slot was read
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
        full = np_ragged(q, k, v, layer, pc.block_tables, seqs, cu, scale)
        rel = np.linalg.norm(got - full) / np.linalg.norm(full)
        assert rel < QUANT_ERR[name], (name, rel)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(NP_DTYPES))
def test_decode_reads_quantized_cache_bf16_queries(name, backend):
    """One query per sequence, bf16 queries over a quantized cache."""
    seqs, pc, q, cu, kq, vq, deq_k, deq_v, k, v, scales = _quantized_case(0, name)
    decode = [(1, kv) for _, kv in seqs]
    rng = np.random.default_rng(9)
    qd = rng.standard_normal((len(seqs), q.shape[1], q.shape[2])).astype(np.float32)
    qd = np.asarray(jnp.asarray(qd, jnp.bfloat16)).astype(np.float32)
    scale = q.shape[-1] ** -0.5
    kv_lens = np.asarray([kv for _, kv in seqs], np.int32)
    got = np.asarray(paged_decode_attention(
        jnp.asarray(qd, jnp.bfloat16), jnp.asarray(kq), jnp.asarray(vq),
        jnp.asarray(pc.block_tables), jnp.asarray(kv_lens), scale=scale, layer=1,
        backend=backend, kv_scale=jnp.asarray(scales[1])).astype(jnp.float32), np.float64)
    cu1 = np.arange(len(seqs) + 1, dtype=np.int32)
    want = np_ragged(qd, deq_k, deq_v, 1, pc.block_tables, decode, cu1, scale)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=1e-2)  # bf16 outputs


@pytest.mark.parametrize("backend", BACKENDS)  # "cpu": FP8 bytes copied by the native kernel
@pytest.mark.parametrize("name", list(NP_DTYPES))
def test_write_kv_stores_numpy_quantization(name, backend):
    rng = np.random.default_rng(3)
    layers, hkv, blocks, bs, d = 2, 2, 6, 8, 64
    dt = NP_DTYPES[name]
    k_cache = np.zeros((layers, hkv, blocks, bs, d), dt)
    v_cache = np.zeros_like(k_cache)
    n = 11
    k = rng.standard_normal((n, hkv, d)).astype(np.float32) * 3
    v = rng.standard_normal((n, hkv, d)).astype(np.float32) * 0.5
    k[0, 0, 0] = 1e6  # saturates
    slots = rng.permutation(blocks * bs)[:n].astype(np.int32)
    slots[3] = -1  # padding: not written
    scale = np.broadcast_to(np.asarray([[0.05, 0.02], [0.01, 0.004]], np.float32)[..., None],
                            (2, hkv, d)).copy()  # [K/V, head, channel]
    scale[0, 1, :8] = 0.3
    kc, vc = write_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_cache),
                      jnp.asarray(v_cache), jnp.asarray(slots), layer=1, backend=backend,
                      kv_scale=jnp.asarray(scale))
    kc, vc = np.asarray(kc), np.asarray(vc)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        want_k[1, :, slot // bs, slot % bs] = _np_quantize(k[t], scale[0], name)
        want_v[1, :, slot // bs, slot % bs] = _np_quantize(v[t], scale[1], name)
    assert kc.dtype == dt
    np.testing.assert_array_equal(kc.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), want_v.view(np.uint8))
    assert float(kc[1, 0, slots[0] // bs, slots[0] % bs, 0].astype(np.float32)) == \
        qmax(KV_CACHE_DTYPES[name])  # saturated, not wrapped or NaN


def test_quantized_cache_needs_its_scales():
    cache = jnp.zeros((1, 2, 4, 8, 64), jnp.int8)
    q = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="kv_scale"):
        paged_decode_attention(q, cache, cache, jnp.zeros((1, 2), jnp.int32),
                               jnp.ones(1, jnp.int32), scale=1.0, layer=0, backend="xla")
    with pytest.raises(ValueError, match="kv_scale"):
        write_kv(jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 64)), cache, cache,
                 jnp.zeros(1, jnp.int32), layer=0, backend="xla")
    with pytest.raises(ValueError, match=r"kv_scale.*\(2, 2, 64\)"):
        paged_decode_attention(q, cache, cache, jnp.zeros((1, 2), jnp.int32),
                               jnp.ones(1, jnp.int32), scale=1.0, layer=0, backend="xla",
                               kv_scale=jnp.ones((2, 2)))


@pytest.mark.parametrize("name", list(NP_DTYPES))
def test_copies_and_swaps_move_quantized_bytes(name):
    rng = np.random.default_rng(4)
    shape = (2, 2, 8, 4, 16)
    raw = rng.integers(0, 256, int(np.prod(shape)), dtype=np.uint8)
    if name != "int8":
        # Finite values, plus a few canonical NaNs: XLA may canonicalize other NaN encodings
        # (quantization never stores a NaN: it saturates).
        raw[np.isnan(raw.view(NP_DTYPES[name]).astype(np.float32))] = 0
        raw[:10] = 0x7F
    cache = raw.view(NP_DTYPES[name]).reshape(shape)
    k, v = jnp.asarray(cache), jnp.asarray(cache[::-1].copy())
    kc, vc = copy_blocks(k, v, jnp.asarray([[1, 5], [2, 6], [-1, -1]], np.int32),
                         backend="xla")
    want = cache.copy()
    want[:, :, 5], want[:, :, 6] = cache[:, :, 1], cache[:, :, 2]
    np.testing.assert_array_equal(np.asarray(kc).view(np.uint8), want.view(np.uint8))
    out_k, out_v = swap_out(k, v, np.asarray([3, 0], np.int32))
    np.testing.assert_array_equal(np.asarray(out_k).view(np.uint8),
                                  cache[:, :, [3, 0]].view(np.uint8))
    back_k, _ = swap_in(jnp.zeros_like(k), jnp.zeros_like(v), out_k, out_v,
                        np.asarray([7, 2], np.int32))
    np.testing.assert_array_equal(np.asarray(back_k)[:, :, [7, 2]].view(np.uint8),
                                  cache[:, :, [3, 0]].view(np.uint8))


def test_scales_from_amax():
    amax = np.asarray([[[[2.0, 0.5], [0.0, 0.0]], [[1.0, 0.25], [4.0, 3.0]]]],
                      np.float32)  # [layer, K/V, head, channel]
    s = scales_from_amax(amax, jnp.int8)
    np.testing.assert_allclose(s[0, 0], [[2.0 * 1.2 / 127, 0.5 * 1.2 / 127], [1.0, 1.0]])
    h = scales_from_amax(amax, jnp.int8, "per_head")
    np.testing.assert_allclose(h[0, 1], [[1.2 / 127] * 2, [4.0 * 1.2 / 127] * 2])
    t = scales_from_amax(amax, jnp.float8_e4m3fn, "per_tensor")
    np.testing.assert_allclose(t[0, 1], np.full((2, 2), 4.0 * 2 / 448))
    with pytest.raises(ValueError, match="kv_scale_granularity"):
        scales_from_amax(amax, jnp.int8, "per_token")


@pytest.mark.parametrize("name", list(NP_DTYPES))
@pytest.mark.parametrize("idx", [0, 1])
def test_mosaic_kernels_read_quantized_cache(idx, name, monkeypatch):
    """The Mosaic GPU kernels (interpreted on CPU, compiled on a Hopper) behind the public
    entry points with PAGEDJAX_PALLAS_LOWERING=mosaic: bf16 queries over an int8 / FP8 cache,
    the 1-byte pages widened in SMEM, K's scales on the queries and V's on the output. Against
    float64 on the dequantized values (bf16 tolerance), with NaN bytes in every unowned slot
    (FP8) never read; the mixed step through the ragged kernel and one decode row per sequence
    through the decode kernel."""
    from pallas_kernels import mosaic_decode_attention as mdec
    from pallas_kernels import mosaic_ragged_attention as mrag
    from pallas_kernels.backend import ENV_LOWERING, interpret_mode

    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic kernels issue wgmma: Hopper (sm_90) only")
    monkeypatch.setenv(ENV_LOWERING, "mosaic")
    calls = []
    for mod, fn in ((mdec, "mosaic_paged_decode"), (mrag, "mosaic_ragged_attention")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    seqs, pc, q, cu, kq, vq, deq_k, deq_v, k, v, scales = _quantized_case(idx, name)
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16)).astype(np.float32)
    scale = q.shape[-1] ** -0.5
    kv_lens = np.asarray([kv for _, kv in seqs], np.int32)
    layer = 1
    got = np.asarray(ragged_paged_attention(
        jnp.asarray(qb, jnp.bfloat16), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(kv_lens),
        jnp.asarray(pc.block_tables), jnp.asarray(cu), jnp.int32(len(seqs)), scale=scale,
        layer=layer, backend="pallas", kv_scale=jnp.asarray(scales[layer])
    ).astype(jnp.float32), np.float64)
    want = np_ragged(qb, deq_k, deq_v, layer, pc.block_tables, seqs, cu, scale)
    assert np.isfinite(got).all(), name
    tol = 3e-2 * np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=tol, rtol=1e-2)
    qd = qb[cu[1:] - 1]  # each sequence's last token as a decode row
    got_d = np.asarray(paged_decode_attention(
        jnp.asarray(qd, jnp.bfloat16), jnp.asarray(kq), jnp.asarray(vq),
        jnp.asarray(pc.block_tables), jnp.asarray(kv_lens), scale=scale, layer=layer,
        backend="pallas", kv_scale=jnp.asarray(scales[layer])).astype(jnp.float32),
        np.float64)
    want_d = np_ragged(qd, deq_k, deq_v, layer, pc.block_tables, [(1, kv) for _, kv in seqs],
                       np.arange(len(seqs) + 1, dtype=np.int32), scale)
    assert np.isfinite(got_d).all(), name
    np.testing.assert_allclose(got_d, want_d, atol=tol, rtol=1e-2)
    assert len(calls) == 2  # both went to the Mosaic kernels, not Triton
