"""The Mosaic GPU paged decode kernel, run in jax's GPU interpreter on CPU, against the
float64 numpy reference, with poisoned unused blocks and page tails; its selection behind
``paged_decode_attention`` (PAGEDJAX_PALLAS_LOWERING=mosaic) and the Triton fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_decode_attention as mdec
from pallas_kernels import paged_decode_attention
from pallas_kernels.backend import ENV_LOWERING, interpret_mode

from ._paged import DTYPES, TOL, dense_kv, make_paged, np_attention

# (ctx lens, group, head_dim, block_size, dtype, num_kv_heads, splits): lengths 1, bs - 1,
# bs, bs + 1, chunk (64) +- 1 and several chunks; pages under, at and over the 64-token
# chunk; GQA 1/3/4/8; one split, several and the automatic count.
CASES = [
    ([1, 15, 16, 17], 1, 64, 16, "bfloat16", 2, 1),
    ([63, 64, 65], 4, 128, 16, "float16", 1, 2),
    ([31, 32, 33, 200], 3, 64, 32, "bfloat16", 2, None),
    ([70, 5], 8, 64, 64, "bfloat16", 1, 1),
    ([129, 300], 2, 128, 128, "float16", 1, 3),
    ([257, 40, 1], 4, 128, 64, "bfloat16", 2, 2),
    # head dim 256: two column programs per split, each gathering its half of V
    ([65, 3, 130], 2, 256, 32, "bfloat16", 2, 2),
    ([1, 64], 4, 256, 64, "float16", 1, None),
]


def _call(case, q, layer, **kw):
    """Interpreted on CPU; compiled on a lent Hopper GPU (the GPU suite's kernel stage)."""
    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic decode kernel issues wgmma: Hopper (sm_90) only")
    k, v, tables, lens = case
    out = mdec.mosaic_paged_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                   jnp.asarray(tables), jnp.asarray(lens), jnp.int32(layer),
                                   interpret=interpret_mode(), **kw)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_mosaic_decode_matches_reference_and_ignores_poison(idx):
    lens, group, d, bs, dtype, hkv, splits = CASES[idx]
    rng = np.random.default_rng(4000 + idx)
    pc = make_paged(rng, ctx_lens=lens, num_layers=2, num_kv_heads=hkv, block_size=bs,
                    head_dim=d, dtype=dtype, share_prefix=len(lens) > 1)
    q = rng.standard_normal((len(lens), hkv * group, d)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, DTYPES[dtype]))
    scale, layer = d ** -0.5, 1
    expect = np.stack([
        np_attention(q[s], dense_kv(pc.k_clean, layer, pc.block_tables[s], c),
                     dense_kv(pc.v_clean, layer, pc.block_tables[s], c), scale)
        for s, c in enumerate(lens)])
    clean = _call((pc.k_clean, pc.v_clean, pc.block_tables, pc.ctx_lens), q, layer,
                  scale=scale, num_splits=splits)
    poisoned = _call((pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens), q, layer,
                     scale=scale, num_splits=splits)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    # NaN / huge values in unowned blocks, in page tails and junk table ids change nothing.
    np.testing.assert_array_equal(poisoned, clean)


def test_inputs_sliced_from_one_packed_array():
    """The runner slices a step's lengths and block tables out of one packed int array inside
    its jit, at offsets XLA may pass on as views; Mosaic's custom call rejects an input that
    is not 256-byte aligned. On the H200 (stop 52) the whole-model step failed so and passes
    with `own_buffer`; this small jit passed there with it disabled too (XLA gave these slices
    buffers of their own), so it guards the results, and `test_index_inputs_are_own_buffers`
    the structure."""
    lens, group, d, bs, dtype, hkv, splits = CASES[2]
    rng = np.random.default_rng(77)
    pc = make_paged(rng, ctx_lens=lens, num_layers=2, num_kv_heads=hkv, block_size=bs,
                    head_dim=d, dtype=dtype)
    q = np.asarray(jnp.asarray(rng.standard_normal((len(lens), hkv * group, d)),
                               DTYPES[dtype]))
    direct = _call((pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens), q, 1,
                   scale=0.1, num_splits=splits)
    lens32, tab32 = np.asarray(pc.ctx_lens, np.int32), np.asarray(pc.block_tables, np.int32)
    packed = np.concatenate([np.arange(5, dtype=np.int32), lens32, tab32.ravel()])

    @jax.jit
    def step(packed, q, k, v):
        n = lens32.size
        ctx = packed[5:5 + n]  # 20 bytes in: never 256-byte aligned
        tables = packed[5 + n:].reshape(tab32.shape)
        return mdec.mosaic_paged_decode(q, k, v, tables, ctx, jnp.int32(1), scale=0.1,
                                        num_splits=splits, interpret=interpret_mode())

    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic decode kernel issues wgmma: Hopper (sm_90) only")
    out = step(jnp.asarray(packed), jnp.asarray(q), jnp.asarray(pc.k_poison),
               jnp.asarray(pc.v_poison))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), direct)


def test_index_inputs_are_own_buffers():
    """Both Mosaic kernels take their lengths / block tables from a `pad` (`own_buffer`), never
    straight from the caller's array, which may be a view into a packed buffer."""
    from pallas_kernels import mosaic_ragged_attention as mrag

    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    kc = jnp.zeros((1, 1, 8, 16, 64), jnp.bfloat16)
    tables, lens = jnp.zeros((2, 4), jnp.int32), jnp.array([5, 9], jnp.int32)
    cu = jnp.array([0, 1, 2], jnp.int32)
    calls = {
        "decode": (lambda t, n: mdec.mosaic_paged_decode(q, kc, kc, t, n, jnp.int32(0),
                                                         scale=0.1, interpret=True), (1, 2)),
        "ragged": (lambda t, n: mrag.mosaic_ragged_attention(q, kc, kc, n, t, cu, jnp.int32(2),
                                                             jnp.int32(0), scale=0.1,
                                                             interpret=True), (2,)),
    }
    kernel_prims = ("pallas_call", "custom_vmap_call", "mpmd_map")
    for name, (fn, checked) in calls.items():
        (outer,) = jax.make_jaxpr(fn)(tables, lens).jaxpr.eqns  # the jitted wrapper
        eqns = outer.params["jaxpr"].jaxpr.eqns
        kernel = [e for e in eqns if e.primitive.name in kernel_prims]
        assert len(kernel) == 1, (name, [e.primitive.name for e in eqns])
        made_by = {id(v): (e.primitive.name if e.primitive.name != "jit"
                           else e.params.get("name")) for e in eqns for v in e.outvars}
        for i in checked:
            assert made_by.get(id(kernel[0].invars[i])) in ("pad", "_pad"), (
                name, i, made_by.get(id(kernel[0].invars[i])))


def test_padding_rows_are_zero():
    rng = np.random.default_rng(5)
    pc = make_paged(rng, ctx_lens=[40, 1], num_layers=1, num_kv_heads=1, block_size=16,
                    head_dim=64, dtype="bfloat16")
    lens = np.array([40, 0], np.int32)  # row 1: a padding row of the decode batch
    q = np.asarray(jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.bfloat16))
    out = _call((pc.k_poison, pc.v_poison, pc.block_tables, lens), q, 0, scale=0.125)
    assert np.all(out[1] == 0) and np.all(np.isfinite(out[0]))


def test_selected_by_lowering_and_falls_back(monkeypatch):
    """On CPU (interpreted). PAGEDJAX_PALLAS_LOWERING=mosaic routes what the kernel covers to
    it (windowed and soft-capped calls included) and fp32 calls to Triton; the results agree
    with Triton's. (Quantized caches: `tests/kernels/test_kv_quant.py`.)"""
    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    if not interpret_mode() and not mdec.hopper_target():
        pytest.skip("the Mosaic decode kernel issues wgmma: Hopper (sm_90) only")
    rng = np.random.default_rng(6)
    pc = make_paged(rng, ctx_lens=[50, 20], num_layers=1, num_kv_heads=1, block_size=16,
                    head_dim=64, dtype="bfloat16")
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    args = (q, jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison), jnp.asarray(pc.block_tables),
            jnp.asarray(pc.ctx_lens))
    calls = []
    real = mdec.mosaic_paged_decode
    monkeypatch.setattr(mdec, "mosaic_paged_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for lowering in ("mosaic", "triton"):
        monkeypatch.setenv(ENV_LOWERING, lowering)
        outs[lowering] = [np.asarray(paged_decode_attention(*args, scale=0.125, backend="pallas",
                                                            **kw), np.float32)
                          for kw in ({}, {"window": 8}, {"softcap": 5.0})]
        assert len(calls) == 3
    for m, t in zip(outs["mosaic"], outs["triton"], strict=True):
        np.testing.assert_allclose(m, t, atol=TOL["bfloat16"], rtol=0)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    monkeypatch.setenv(ENV_LOWERING, "mosaic")
    paged_decode_attention(*f32, scale=0.125, backend="pallas")
    assert len(calls) == 3


def test_mosaic_api_present_where_interpreted():
    """On CPU (CI) the Mosaic tests must run, never skip: the jax the project pins has the
    API."""
    if interpret_mode():
        assert mdec.mosaic_available()


def test_supports_scope():
    if not mdec.mosaic_available():
        pytest.skip("this jax lacks the Mosaic GPU API the kernels use (jax >= 0.11.2)")
    bf = jnp.zeros((2, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((1, 2, 4, 16, 128), jnp.bfloat16)
    assert mdec.supports(bf, cache, quantized=False)
    assert not mdec.supports(bf, cache, quantized=True)  # a bf16 cache is not quantized
    for kv in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
        assert mdec.supports(bf, cache.astype(kv), quantized=True)
        assert not mdec.supports(bf.astype(jnp.float32), cache.astype(kv), quantized=True)
    assert not mdec.supports(bf.astype(jnp.float32), cache.astype(jnp.float32), quantized=False)
    q256 = jnp.zeros((2, 8, 256), jnp.bfloat16)
    assert mdec.supports(q256, jnp.zeros((1, 2, 4, 16, 256), jnp.bfloat16), quantized=False)
    assert mdec.supports(q256, jnp.zeros((1, 2, 4, 64, 256), jnp.bfloat16), quantized=False,
                         ragged=True)
    # 128-token chunks at head dim 256: the K and V rings alone would take 192 KiB of SMEM
    assert not mdec.supports(q256, jnp.zeros((1, 2, 4, 128, 256), jnp.bfloat16),
                             quantized=False)
    assert not mdec.supports(jnp.zeros((2, 8, 96), jnp.bfloat16),
                             jnp.zeros((1, 2, 4, 16, 96), jnp.bfloat16), quantized=False)
    assert not mdec.supports(bf, jnp.zeros((1, 2, 4, 8, 128), jnp.bfloat16), quantized=False)
    big_pages = jnp.zeros((1, 2, 4, 128, 128), jnp.bfloat16)
    assert mdec.supports(bf, big_pages, quantized=False)
    assert not mdec.supports(bf, big_pages, quantized=False, ragged=True)  # it spilled
