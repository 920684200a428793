"""The native CPU matmul for packed weights (`pallas_kernels/csrc/packed_matmul_cpu.cc`) and
the XLA dequantization (`models.qlinear.dequantize`) against float64 numpy on the same
dequantized values, over 4- and 8-bit codes, signed and unsigned, with and without offsets,
float16 and float32 scales, group sizes 16 / 32 / K, canonical and panel layouts, widths that
are not multiples of 64, 1-37 rows, fp32 and bf16 inputs."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.packed import PackedWeight, pack_gguf, quantize_int8_per_channel
from models.qlinear import dequantize, dequantize_columns, to_panels
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")


def _weights(k: int, n: int, rng) -> dict[str, PackedWeight]:
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = {t: pack_gguf(gguf.quants.quantize(w, gguf.GGMLQuantizationType[t]), t, (k, n))
           for t in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")}
    out["int8-per-channel"] = quantize_int8_per_channel(w.T)
    q8 = out["Q8_0"]  # 8-bit, group 16, float32 scales and offsets (a K-quant's shape)
    out["g16-f32-offset"] = PackedWeight(
        q8.codes, np.repeat(q8.scale.astype(np.float32), 2, axis=0),
        rng.standard_normal((k // 16, n)).astype(np.float32) * 0.01, 16, 8, True)
    return out


@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("m", [1, 3, 5, 37])
def test_native_matmul_matches_numpy(m, panels):
    rng = np.random.default_rng(m)
    k, n = 512, 200  # 200: a partial last panel
    for name, pw in _weights(k, n, rng).items():
        leaves = {a: jnp.asarray(v) for a, v in pw.arrays().items()}
        if panels:
            leaves = to_panels(leaves)
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = np.asarray(jax.jit(cpu_native.packed_matmul_cpu, static_argnums=2)(
            jnp.asarray(x), leaves, n), np.float64)
        want = x.astype(np.float64) @ pw.dequantize().astype(np.float64)
        np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(want).max(), rtol=0,
                                   err_msg=name)


def test_bf16_inputs_and_leading_axes():
    rng = np.random.default_rng(0)
    pw = _weights(256, 96, rng)["Q4_1"]
    leaves = to_panels({a: jnp.asarray(v) for a, v in pw.arrays().items()})
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
    got = cpu_native.packed_matmul_cpu(x, leaves, 96)
    assert got.shape == (2, 3, 96) and got.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64) @ pw.dequantize().astype(np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=0.05 * np.abs(want).max())


def test_xla_dequantize_and_column_gather():
    rng = np.random.default_rng(1)
    k, n = 256, 130
    for name, pw in _weights(k, n, rng).items():
        leaves = {a: jnp.asarray(v) for a, v in pw.arrays().items()}
        np.testing.assert_array_equal(np.asarray(dequantize(leaves, k)), pw.dequantize(),
                                      err_msg=name)
        cols = jnp.asarray([0, 129, 64, 7], jnp.int32)
        want = pw.dequantize()[:, [0, 129, 64, 7]].T
        for layout in (leaves, to_panels(leaves)):
            np.testing.assert_array_equal(np.asarray(dequantize_columns(layout, cols, k)), want,
                                          err_msg=name)


def test_bad_arguments_are_refused():
    pw = quantize_int8_per_channel(np.ones((64, 8), np.float32))
    leaves = {a: jnp.asarray(v) for a, v in pw.arrays().items()}
    with pytest.raises(Exception, match="K / group|rows"):
        cpu_native.packed_matmul_cpu(jnp.ones((1, 48)), leaves)  # K does not match the codes
    with pytest.raises(ValueError, match="output width"):
        cpu_native.packed_matmul_cpu(jnp.ones((1, 64)), to_panels(leaves))


@pytest.mark.parametrize("m", [1, 20])
def test_pallas_kernel_matches_numpy(m):
    """The GPU kernel (`pallas_kernels.packed_matmul`), interpreted: codes widened and scaled
    per 16-row half inside the program, fp32 accumulation; and its XLA reference."""
    from pallas_kernels.packed_matmul import packed_matmul

    rng = np.random.default_rng(10 + m)
    k, n = 128, 80  # a partial column block
    for name, pw in _weights(k, n, rng).items():
        leaves = {a: jnp.asarray(v) for a, v in pw.arrays().items()}
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ pw.dequantize().astype(np.float64)
        for backend in ("pallas", "xla"):
            got = np.asarray(packed_matmul(jnp.asarray(x), leaves, backend=backend), np.float64)
            np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(want).max(), rtol=0,
                                       err_msg=f"{name} {backend}")
    with pytest.raises(ValueError, match="multiple of 32"):
        packed_matmul(jnp.ones((1, 48)), {"codes": jnp.ones((48, 8), jnp.int8),
                                          "scale": jnp.ones((3, 8))})
