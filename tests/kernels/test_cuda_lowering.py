"""Every Pallas kernel lowers through Triton for CUDA on a CPU-only host.

An abstract H100 (``jax.sharding.AbstractDevice`` inside ``use_abstract_mesh``) makes
``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` run the real Pallas->Triton
lowering (``interpret`` is off because the backend module sees a GPU target) and give it a
compute capability (9.0). We then pull each ``__gpu$xla.gpu.triton`` custom call's Triton
IR out of the StableHLO, parse it back with the Triton dialect loaded and run the MLIR
verifier, so malformed Triton (e.g. non-power-of-two tensors) fails here, not on a GPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels import copy_blocks, paged_decode_attention, ragged_paged_attention, write_kv
from pallas_kernels._common import next_pow2
from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.backend import interpret_mode

S = jax.ShapeDtypeStruct
TRITON_TARGET = "__gpu$xla.gpu.triton"


def _h100_mesh():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132,
                                         platform="cuda")
    return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)


def _lower_for_cuda(fn, *args):
    with jax.sharding.use_abstract_mesh(_h100_mesh()), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Pallas-Triton deprecation
        assert not interpret_mode()
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _triton_modules(lowered) -> list[str]:
    """Parse and verify the Triton module inside each Triton custom call."""
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if (child.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.operation.attributes["call_target_name"]
                                              ).value == TRITON_TARGET):
                        calls.append(child.operation)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        bytecode = ir.StringAttr(config["ir"]).value_bytes
        with triton_lowering._new_ir_context():
            module = ir.Module.parse(bytecode)
            assert module.operation.verify()
            texts.append(str(module))
    return texts


CONFIGS = [  # (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    (9, 3, 64, 16, jnp.bfloat16),
    (32, 8, 128, 16, jnp.bfloat16),
    (8, 8, 128, 8, jnp.float16),
    (8, 1, 64, 32, jnp.float32),
]


def _cache(hkv, d, bs, dtype, layers=2, blocks=64):
    return S((layers, hkv, blocks, bs, d), dtype)


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CONFIGS)
def test_decode_lowers_to_triton(hq, hkv, d, bs, dtype):
    cache = _cache(hkv, d, bs, dtype)
    fn = lambda q, k, v, bt, lens, layer: paged_decode_attention(
        q, k, v, bt, lens, scale=0.1, layer=layer, backend="pallas", num_splits=2)
    lowered = _lower_for_cuda(fn, S((4, hq, d), dtype), cache, cache, S((4, 20), jnp.int32),
                              S((4,), jnp.int32), S((), jnp.int32))
    [module] = _triton_modules(lowered)
    assert "tt.dot" in module and "scf.for" in module


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CONFIGS)
def test_ragged_lowers_to_triton(hq, hkv, d, bs, dtype):
    cache = _cache(hkv, d, bs, dtype)
    fn = lambda q, k, v, kl, bt, cu, n, layer: ragged_paged_attention(
        q, k, v, kl, bt, cu, n, scale=0.1, layer=layer, backend="pallas")
    lowered = _lower_for_cuda(fn, S((48, hq, d), dtype), cache, cache, S((5,), jnp.int32),
                              S((5, 20), jnp.int32), S((6,), jnp.int32), S((), jnp.int32),
                              S((), jnp.int32))
    [module] = _triton_modules(lowered)
    assert "tt.dot" in module
    assert "output_operand_alias" in lowered.as_text()


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CONFIGS[:3])
def test_cache_ops_lower_to_triton(hq, hkv, d, bs, dtype):
    del hq
    cache = _cache(hkv, d, bs, dtype)
    tok = S((7, hkv, d), dtype)
    lowered = _lower_for_cuda(
        lambda k, v, kc, vc, slots, layer: write_kv(k, v, kc, vc, slots, layer=layer,
                                                    backend="pallas"),
        tok, tok, cache, cache, S((7,), jnp.int32), S((), jnp.int32))
    assert len(_triton_modules(lowered)) == 1
    assert lowered.as_text().count("output_operand_alias<") >= 2
    lowered = _lower_for_cuda(lambda kc, vc, m: copy_blocks(kc, vc, m, backend="pallas"),
                              cache, cache, S((3, 2), jnp.int32))
    assert len(_triton_modules(lowered)) == 1
    assert lowered.as_text().count("output_operand_alias<") >= 2


@pytest.mark.parametrize("rows,hidden,dtype", [(1, 4096, jnp.bfloat16), (7, 576, jnp.float32)])
def test_add_rms_norm_lowers_to_triton(rows, hidden, dtype):
    """One Triton call with an add and one without; 576 (SmolLM2) runs a padded 1024 row."""
    x, w = S((rows, hidden), dtype), S((hidden,), dtype)
    lowered = _lower_for_cuda(lambda x, d, w: (add_rms_norm(x, d, w, 1e-5),
                                               add_rms_norm(x, None, w, 1e-5)), x, x, w)
    modules = _triton_modules(lowered)
    assert len(modules) == 2
    assert all(f"tensor<{next_pow2(hidden)}x" in m for m in modules)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantized_cache_kernels_lower_to_triton(kv_dtype):
    """int8 / FP8 caches: the tiles load in the storage dtype and widen to bf16 in the kernel
    (an FP8 load's masked lanes need a float fill: Pallas-Triton cannot cast an int splat)."""
    hq, hkv, d, bs = 9, 3, 64, 16
    cache = _cache(hkv, d, bs, kv_dtype)
    scale = S((2, hkv, d), jnp.float32)
    dec = _lower_for_cuda(
        lambda q, k, v, bt, lens, layer, sc: paged_decode_attention(
            q, k, v, bt, lens, scale=0.1, layer=layer, backend="pallas", num_splits=2,
            kv_scale=sc),
        S((4, hq, d), jnp.bfloat16), cache, cache, S((4, 20), jnp.int32), S((4,), jnp.int32),
        S((), jnp.int32), scale)
    rag = _lower_for_cuda(
        lambda q, k, v, kl, bt, cu, n, layer, sc: ragged_paged_attention(
            q, k, v, kl, bt, cu, n, scale=0.1, layer=layer, backend="pallas", kv_scale=sc),
        S((48, hq, d), jnp.bfloat16), cache, cache, S((5,), jnp.int32), S((5, 20), jnp.int32),
        S((6,), jnp.int32), S((), jnp.int32), S((), jnp.int32), scale)
    stored = {jnp.int8: "xi8>", jnp.float8_e4m3fn: "xf8E4M3FN>",
              jnp.float8_e5m2: "xf8E5M2>"}[kv_dtype]
    for lowered in (dec, rag):
        [module] = _triton_modules(lowered)
        assert "tt.dot" in module and stored in module
    tok = S((7, hkv, d), jnp.bfloat16)
    wr = _lower_for_cuda(
        lambda k, v, kc, vc, slots, layer, sc: write_kv(k, v, kc, vc, slots, layer=layer,
                                                        backend="pallas", kv_scale=sc),
        tok, tok, cache, cache, S((7,), jnp.int32), S((), jnp.int32), scale)
    assert len(_triton_modules(wr)) == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_matmul_lowers_to_triton(bits):
    from pallas_kernels.packed_matmul import packed_matmul

    k, n = 256, 192
    p = {"codes": S((k // 2 if bits == 4 else k, n), jnp.uint8 if bits == 4 else jnp.int8),
         "scale": S((k // 32, n), jnp.float16)}
    if bits == 4:
        p["offset"] = S((k // 32, n), jnp.float16)
    lowered = _lower_for_cuda(lambda x, p: packed_matmul(x, p, backend="pallas"),
                              S((3, k), jnp.bfloat16), p)
    [module] = _triton_modules(lowered)
    assert "tt.dot" in module and ("xi8>" in module)
