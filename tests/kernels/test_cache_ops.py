"""write_kv, copy_blocks and swap: exact results, untouched padding, in-place updates."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import copy_blocks, swap_in, swap_out, write_kv

from ._paged import np_dtype

SHAPE = (2, 3, 12, 8, 64)  # [L, Hkv, NB, bs, D]


def _cache(rng, dtype="float32", shape=SHAPE):
    dt = np_dtype(dtype)
    return (rng.standard_normal(shape).astype(np.float32).astype(dt),
            rng.standard_normal(shape).astype(np.float32).astype(dt))


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_kv_exact_and_skips_padding(backend, dtype):
    rng = np.random.default_rng(5)
    kc, vc = _cache(rng, dtype)
    _, hkv, nb, bs, d = SHAPE
    slots = rng.permutation(nb * bs)[:9].astype(np.int32)
    slots[[2, 6]] = -1  # padding
    k = rng.standard_normal((9, hkv, d)).astype(np.float32).astype(kc.dtype)
    v = rng.standard_normal((9, hkv, d)).astype(np.float32).astype(kc.dtype)
    k_out, v_out = write_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(kc), jnp.asarray(vc),
                            jnp.asarray(slots), layer=1, backend=backend)
    ek, ev = kc.copy(), vc.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            ek[1, :, s // bs, s % bs] = k[t]
            ev[1, :, s // bs, s % bs] = v[t]
    np.testing.assert_array_equal(np.asarray(k_out), ek)
    np.testing.assert_array_equal(np.asarray(v_out), ev)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_write_kv_4d_cache_and_traced_layer(backend):
    rng = np.random.default_rng(6)
    kc, vc = _cache(rng)
    slots = jnp.asarray([3, -1, 50], jnp.int32)
    k = jnp.asarray(rng.standard_normal((3, 3, 64)), jnp.float32)
    one_k, _ = write_kv(k, k, jnp.asarray(kc[0]), jnp.asarray(vc[0]), slots, backend=backend)
    f = jax.jit(lambda layer: write_kv(k, k, jnp.asarray(kc), jnp.asarray(vc), slots,
                                       layer=layer, backend=backend))
    full_k, _ = f(jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(full_k[0]), np.asarray(one_k))
    np.testing.assert_array_equal(np.asarray(full_k[1]), kc[1])


def _copies_of_size(hlo: str, min_elems: int) -> list[str]:
    """HLO ``copy`` instructions whose result has at least ``min_elems`` elements."""
    big = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\w+\[([\d,]*)\][^ ]*\s+copy(-start)?\(", line)
        if m:
            n = int(np.prod([int(x) for x in m.group(1).split(",") if x] or [1]))
            if n >= min_elems:
                big.append(line.strip())
    return big


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_write_kv_and_copy_blocks_update_in_place(backend):
    """With donated caches the compiled HLO aliases output to input and never copies them."""
    cache = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    tok = jax.ShapeDtypeStruct((5, SHAPE[1], SHAPE[4]), jnp.float32)
    slots = jax.ShapeDtypeStruct((5,), jnp.int32)
    write = jax.jit(functools.partial(write_kv, layer=1, backend=backend), donate_argnums=(2, 3))
    hlo_w = write.lower(tok, tok, cache, cache, slots).compile().as_text()
    copy = jax.jit(functools.partial(copy_blocks, backend=backend), donate_argnums=(0, 1))
    hlo_c = copy.lower(cache, cache, jax.ShapeDtypeStruct((4, 2), jnp.int32)).compile().as_text()
    for hlo in (hlo_w, hlo_c):
        assert re.search(r"input_output_alias=\{ \{0\}: \(\d+, \{\}", hlo), hlo[:400]
        assert re.search(r"\{1\}: \(\d+, \{\}", hlo)
        assert _copies_of_size(hlo, int(np.prod(SHAPE[2:]))) == []


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("dtype,shape", [("float32", SHAPE), ("bfloat16", SHAPE),
                                         # 2 and 4 row tiles per block (tiled copy)
                                         ("float32", (1, 2, 12, 128, 64)),
                                         ("bfloat16", (2, 1, 12, 64, 256))])
def test_copy_blocks_exact(backend, dtype, shape):
    rng = np.random.default_rng(8)
    kc, vc = _cache(rng, dtype, shape)
    mapping = np.array([[1, 4], [-1, 2], [7, 9], [7, 11], [-1, -1]], np.int32)
    k_out, v_out = copy_blocks(jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(mapping),
                               backend=backend)
    ek, ev = kc.copy(), vc.copy()
    for src, dst in mapping:
        if src >= 0:
            ek[:, :, dst] = kc[:, :, src]
            ev[:, :, dst] = vc[:, :, src]
    np.testing.assert_array_equal(np.asarray(k_out), ek)
    np.testing.assert_array_equal(np.asarray(v_out), ev)
    # Blocks that are not destinations keep their bytes, block 2 (padding dst) included.
    untouched = [b for b in range(SHAPE[2]) if b not in (4, 9, 11)]
    np.testing.assert_array_equal(np.asarray(k_out)[:, :, untouched], kc[:, :, untouched])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_swap_round_trip_bit_exact(dtype):
    rng = np.random.default_rng(9)
    kc, vc = _cache(rng, dtype)
    ids = np.array([5, 0, 11], np.int32)
    k_host, v_host = swap_out(jnp.asarray(kc), jnp.asarray(vc), ids)
    assert isinstance(k_host, np.ndarray) and k_host.shape == (2, 3, 3, 8, 64)
    # Host pool as the engine keeps it, then back into different device blocks.
    pool_k = np.zeros((2, 3, 6, 8, 64), kc.dtype)
    pool_v = np.zeros_like(pool_k)
    pool_k[:, :, [4, 1, 2]] = k_host
    pool_v[:, :, [4, 1, 2]] = v_host
    dest = np.array([3, 7, 1], np.int32)
    k_new, v_new = swap_in(jnp.zeros_like(jnp.asarray(kc)), jnp.zeros_like(jnp.asarray(vc)),
                           pool_k[:, :, [4, 1, 2]], pool_v[:, :, [4, 1, 2]], dest)
    np.testing.assert_array_equal(np.asarray(k_new)[:, :, dest].view(np.uint8),
                                  kc[:, :, ids].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v_new)[:, :, dest].view(np.uint8),
                                  vc[:, :, ids].view(np.uint8))
    others = [b for b in range(SHAPE[2]) if b not in dest]
    np.testing.assert_array_equal(np.asarray(k_new)[:, :, others], 0)


def test_swap_pads_to_buckets_and_compiles_once_per_bucket():
    """1..8 blocks share one gather and one scatter program; padding never writes the
    cache (a full round trip of n blocks leaves every other block bit-identical)."""
    from pallas_kernels import swap

    rng = np.random.default_rng(10)
    kc, vc = (jnp.asarray(x) for x in _cache(rng, "float32"))
    before = (swap._gather._cache_size(), swap._scatter._cache_size())
    for n in range(1, 9):
        ids = rng.permutation(SHAPE[2])[:n].astype(np.int32)
        k_host, v_host = swap_out(kc, vc, ids)
        assert k_host.shape == (2, 3, n, 8, 64)
        np.testing.assert_array_equal(k_host, np.asarray(kc)[:, :, ids])
        dest = rng.permutation(SHAPE[2])[:n].astype(np.int32)
        k_ref = np.asarray(kc).copy()
        k_ref[:, :, dest] = k_host
        kc2, vc2 = swap_in(jnp.array(kc), jnp.array(vc), k_host, v_host, dest)
        np.testing.assert_array_equal(np.asarray(kc2), k_ref)
    after = (swap._gather._cache_size(), swap._scatter._cache_size())
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
    assert swap.bucket(9) == 16 and swap.bucket(1) == 8
