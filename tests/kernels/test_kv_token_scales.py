"""Per-token KV factors (`pallas_kernels.kv_quant`, granularity "per_token"): each token is
stored over its own factor ``f = max_d |x_d / s_d| / qmax`` on top of the static channel
scales ``s``, the factor kept as 4 bytes in the cache's factor slots.

int8 caches (FP8 refuses factors: `kv_quant.PER_TOKEN_DTYPE`). The CPU and XLA backends
against a float64 numpy reference on the dequantized values (``stored * s * f``), with the
factor layout rebuilt here from its spec; unused data rows, unused factor rows and the factor
columns of slots no layer uses hold junk bytes and NaN factors and must never be read.
write_kv's values and factors match numpy's; block copies and swaps move factors with their
blocks; per-token error is below per-channel error on outlier tokens; the Pallas kernels
refuse factors with an error naming the setting."""

from __future__ import annotations

import jax.numpy as jnp
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
from pallas_kernels.kv_quant import (
    KV_CACHE_DTYPES,
    data_slots,
    factor_slots,
    qmax,
    read_factors,
    scales_from_amax,
)

from ._paged import make_paged
from .test_kv_quant import CASES, NP_DTYPES, _np_quantize, _poison_bytes
from .test_ragged import np_ragged

LAYERS = 2
BACKENDS = ["xla", "cpu"]


def _factor_cell(layer: int, d: int, n: int) -> tuple[int, int]:
    """(cache slot, first byte column) of `layer`'s factor, from the layout's spec."""
    return n + layer // (d // 4), 4 * (layer % (d // 4))


def _per_token_cache(x: np.ndarray, s: np.ndarray, used: np.ndarray, name: str, rng):
    """``x [L, H, NB, bs, D]`` float32 -> (cache with factor slots, float64 dequantized),
    with every byte no used token owns poisoned."""
    L, H, NB, bs, d = x.shape
    y = x.astype(np.float64) / s[:, :, None, None, :]
    f = np.abs(y).max(-1) / qmax(KV_CACHE_DTYPES[name])  # [L, H, NB, bs]
    f = np.where(f > 0, f, 1.0).astype(np.float32)
    stored = _np_quantize(y / f[..., None], np.float64(1.0), name)
    total = L + factor_slots(L, d)
    cache = _poison_bytes(total * H * NB * bs * d, name, rng).reshape(total, H, NB, bs, d)
    nan32 = np.full(1, np.nan, np.float32).view(np.uint8)
    raw = cache.view(np.uint8)
    for layer in range(L):
        slot, col = _factor_cell(layer, d, L)
        cache[layer][:, used] = stored[layer][:, used]
        raw[slot, :, :, :, col:col + 4] = nan32  # unused rows: NaN factors
        fb = f[layer].view(np.uint8).reshape(H, NB, bs, 4)
        raw[slot][:, used, col:col + 4] = fb[:, used]
    deq = stored.astype(np.float64) * f[..., None].astype(np.float64) * s[:, :, None, None, :]
    return cache, deq, f


def _case(idx: int, name: str):
    seqs, group, head_dim, bs, hkv = CASES[idx]
    rng = np.random.default_rng(900 + idx)
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=LAYERS, num_kv_heads=hkv,
                    block_size=bs, head_dim=head_dim, dtype="float32", share_prefix=True)
    mag = rng.uniform(0.5, 4.0, (LAYERS, 2, hkv, head_dim)).astype(np.float32)
    mag[:, 0, :, ::16] *= 8  # outlier channels
    tok = rng.lognormal(0.0, 0.7, pc.k_clean.shape[:4]).astype(np.float32)  # token magnitudes
    k = pc.k_clean * mag[:, 0, :, None, None, :] * tok[..., None]
    v = pc.v_clean * mag[:, 1, :, None, None, :] * tok[..., None]
    amax = np.stack([np.abs(k).max(axis=(2, 3)), np.abs(v).max(axis=(2, 3))], axis=1)
    scales = scales_from_amax(amax, KV_CACHE_DTYPES[name])  # [L, 2, Hkv, D]
    used = np.zeros(k.shape[2:4], bool)
    for s, (_, kv) in enumerate(seqs):
        for t in range(kv):
            used[pc.block_tables[s, t // bs], t % bs] = True
    kc, deq_k, _ = _per_token_cache(k, scales[:, 0], used, name, rng)
    vc, deq_v, _ = _per_token_cache(v, scales[:, 1], used, name, rng)
    cu = np.concatenate([[0], np.cumsum([ql for ql, _ in seqs])]).astype(np.int32)
    q = rng.standard_normal((cu[-1], hkv * group, head_dim)).astype(np.float32)
    return seqs, pc, q, cu, kc, vc, deq_k, deq_v, k, v, scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_ragged_and_decode_read_token_factors(idx, backend):
    name = "int8"
    seqs, pc, q, cu, kc, vc, deq_k, deq_v, k, v, scales = _case(idx, name)
    scale = q.shape[-1] ** -0.5
    kv_lens = np.asarray([kv for _, kv in seqs], np.int32)
    for layer in range(LAYERS):
        got = np.asarray(ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(kv_lens),
            jnp.asarray(pc.block_tables), jnp.asarray(cu), jnp.int32(len(seqs)), scale=scale,
            layer=layer, backend=backend, kv_scale=jnp.asarray(scales[layer]),
            token_scales=True), np.float64)
        want = np_ragged(q, deq_k, deq_v, layer, pc.block_tables, seqs, cu, scale)
        assert np.isfinite(got).all(), (name, backend)  # no poisoned byte was read
        np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(want).max(), rtol=1e-5)
        if backend == "xla":  # the work-item formulation too (larger steps take it)
            items = np.asarray(ragged_paged_attention(
                jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(kv_lens),
                jnp.asarray(pc.block_tables), jnp.asarray(cu), jnp.int32(len(seqs)),
                scale=scale, layer=layer, backend=backend, kv_scale=jnp.asarray(scales[layer]),
                token_scales=True, block_q=8), np.float64)
            np.testing.assert_allclose(items, want, atol=3e-5 * np.abs(want).max(), rtol=1e-5)
        # Decode: each sequence's last token as its one query.
        last = cu[1:] - 1
        dec = np.asarray(paged_decode_attention(
            jnp.asarray(q[last]), jnp.asarray(kc), jnp.asarray(vc),
            jnp.asarray(pc.block_tables), jnp.asarray(kv_lens), scale=scale, layer=layer,
            backend=backend, kv_scale=jnp.asarray(scales[layer]), token_scales=True),
            np.float64)
        np.testing.assert_allclose(dec, want[last], atol=3e-5 * np.abs(want).max(), rtol=1e-5)


def test_token_factors_beat_channel_scales_on_uneven_tokens():
    """The point of the factors: tokens of very different magnitudes (lognormal here, as
    attention-sink and outlier tokens are) lose less to int8 than under static scales
    (numpy on both sides: the readers are checked against these values above)."""
    seqs, pc, q, cu, kc, vc, deq_k, deq_v, k, v, scales = _case(0, "int8")
    scale = q.shape[-1] ** -0.5
    full = np_ragged(q, k, v, 1, pc.block_tables, seqs, cu, scale)
    per_token = np_ragged(q, deq_k, deq_v, 1, pc.block_tables, seqs, cu, scale)
    s = scales[:, :, :, None, None, :]
    static_k = _np_quantize(k, s[:, 0], "int8").astype(np.float64) * s[:, 0]
    static_v = _np_quantize(v, s[:, 1], "int8").astype(np.float64) * s[:, 1]
    per_channel = np_ragged(q, static_k, static_v, 1, pc.block_tables, seqs, cu, scale)
    err = lambda x: np.linalg.norm(x - full) / np.linalg.norm(full)  # noqa: E731
    assert err(per_token) < 0.7 * err(per_channel), (err(per_token), err(per_channel))
    assert err(per_token) < 0.02


@pytest.mark.parametrize("backend", BACKENDS)  # "cpu": the native byte scatter
def test_write_kv_stores_values_and_factors(backend):
    name = "int8"
    rng = np.random.default_rng(5)
    hkv, blocks, bs, d = 2, 6, 8, 64
    total = LAYERS + factor_slots(LAYERS, d)
    dt = NP_DTYPES[name]
    start = _poison_bytes(total * hkv * blocks * bs * d, name, rng).reshape(
        total, hkv, blocks, bs, d)
    n = 11
    k = rng.standard_normal((n, hkv, d)).astype(np.float32) * rng.lognormal(0, 2, (n, 1, 1))
    v = rng.standard_normal((n, hkv, d)).astype(np.float32) * 0.5
    k[2, 1] = 0.0  # an all-zero vector: factor 1, zeros stored
    slots = rng.permutation(blocks * bs)[:n].astype(np.int32)
    slots[3] = -1  # padding: not written
    scale = np.broadcast_to(np.asarray([[0.05, 0.02], [0.01, 0.004]], np.float32)[..., None],
                            (2, hkv, d)).copy()
    scale[0, 1, :8] = 0.3
    kc, vc = write_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(start), jnp.asarray(start),
                      jnp.asarray(slots), layer=1, backend=backend, kv_scale=jnp.asarray(scale),
                      token_scales=True)
    kc, vc = np.asarray(kc), np.asarray(vc)
    assert kc.dtype == dt
    slot_f, col = _factor_cell(1, d, LAYERS)
    touched = np.zeros(start.shape, bool)
    for cache, x, sc in ((kc, k, scale[0]), (vc, v, scale[1])):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            b, o = slot // bs, slot % bs
            f = cache[slot_f, :, b, o, col:col + 4].copy().view(np.float32)[:, 0]  # [H]
            y = x[t].astype(np.float64) / sc
            want_f = np.abs(y).max(-1) / qmax(KV_CACHE_DTYPES[name])
            want_f = np.where(want_f > 0, want_f, 1.0)
            np.testing.assert_allclose(f, want_f, rtol=1e-6)
            deq = cache[1, :, b, o].astype(np.float64) * f[:, None] * sc
            step = f[:, None] * sc  # one int8 step
            assert (np.abs(deq - x[t]) <= 0.5 * step * (1 + 1e-5)).all()
            # Each token uses the whole range.
            assert (np.abs(cache[1, :, b, o]).max(-1)[want_f != 1.0] == 127).all()
            touched[1, :, b, o] = True
            touched[slot_f, :, b, o, col:col + 4] = True
        # Everything else is as it was, the other layer's slots and factor columns included.
        np.testing.assert_array_equal(cache.view(np.uint8)[~touched],
                                      start.view(np.uint8)[~touched])
    assert np.all(kc[1, 1, slots[2] // bs, slots[2] % bs] == 0)


def test_copies_and_swaps_carry_factors():
    rng = np.random.default_rng(6)
    d = 64
    shape = (LAYERS + factor_slots(LAYERS, d), 2, 8, 4, d)
    cache = jnp.asarray(rng.integers(-128, 128, int(np.prod(shape))).astype(np.int8)
                        .reshape(shape))
    kc, _ = copy_blocks(cache, cache, jnp.asarray([[1, 5], [2, 6]], np.int32), backend="xla")
    for layer in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(read_factors(kc, layer))[:, [5, 6]],
                                      np.asarray(read_factors(cache, layer))[:, [1, 2]])
    out_k, out_v = swap_out(cache, cache, np.asarray([3, 0], np.int32))
    back, _ = swap_in(jnp.zeros_like(cache), jnp.zeros_like(cache), out_k, out_v,
                      np.asarray([7, 2], np.int32))
    for layer in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(read_factors(back, layer))[:, [7, 2]],
                                      np.asarray(read_factors(cache, layer))[:, [3, 0]])


def test_factor_slot_layout():
    for d in (64, 128, 96, 256, 8):
        for n in range(1, 80):
            assert data_slots(n + factor_slots(n, d), d) == n
    assert factor_slots(30, 64) == 2 and factor_slots(30, 128) == 1
    with pytest.raises(ValueError, match="slots"):
        data_slots(18, 64)  # 17 data slots need 2 factor slots (19), 16 need 1 (17)
    with pytest.raises(ValueError, match="head_dim"):
        factor_slots(4, 66)


def test_token_factors_errors_name_the_setting():
    cache = jnp.zeros((3, 2, 4, 8, 64), jnp.int8)
    q = jnp.zeros((1, 4, 64), jnp.float32)
    sc = jnp.ones((2, 2, 64), jnp.float32)
    args = (jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32))
    with pytest.raises(ValueError, match="per_token.*Pallas"):
        paged_decode_attention(q, cache, cache, *args, scale=1.0, layer=0, backend="pallas",
                               kv_scale=sc, token_scales=True)
    with pytest.raises(ValueError, match="per_token.*Pallas"):
        write_kv(jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 64)), cache, cache,
                 jnp.zeros(1, jnp.int32), layer=0, backend="pallas", kv_scale=sc,
                 token_scales=True)
    for dt in (jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2):
        c = jnp.zeros((3, 2, 4, 8, 64), dt)
        with pytest.raises(ValueError, match="per_token.*int8"):
            paged_decode_attention(q, c, c, *args, scale=1.0, layer=0, backend="xla",
                                   kv_scale=None if dt == jnp.float32 else sc,
                                   token_scales=True)
