"""Packed GGUF weights (models/packed.py): every supported type dequantizes exactly as gguf's
reference, byte budgets, the 4-bit layout, repack exactness, int8 per-channel quantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.packed import PackedWeight, pack_gguf, quantize_int8_per_channel, repack

WRITABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # gguf.quants.quantize writes these
# K-quants gguf cannot write: random block bytes, with the f16 d (and dmin) at these offsets
# overwritten by small finite values.
K_QUANT_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_raw(qtype: str, k: int, n: int, seed: int) -> np.ndarray:
    """[N, K_bytes] uint8, as GGUFReader exposes a quantized tensor's data."""
    rng = np.random.default_rng(seed)
    t = GGMLQuantizationType[qtype]
    if qtype in WRITABLE:
        w = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
        w[0, :32] *= 40.0  # an outlier block
        w[1, 32:64] = 0.0  # an all-zero block (d == 0)
        return gguf.quants.quantize(w, t)
    block_elems, block_bytes = GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    for at in K_QUANT_F16_FIELDS[qtype]:
        vals = rng.uniform(-0.02, 0.02, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = vals[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


def _reference(raw: np.ndarray, qtype: str, k: int, n: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).T


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


ALL_TYPES = WRITABLE + list(K_QUANT_F16_FIELDS)


def test_kquants_cannot_be_written_by_gguf():
    # If a future gguf learns to write K-quants, the tests could quantize real arrays for them too.
    with pytest.raises(NotImplementedError):
        gguf.quants.quantize(np.zeros((1, 256), np.float32), GGMLQuantizationType.Q4_K)


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize(("k", "n"), [(256, 8), (512, 24)])
def test_dequantize_matches_gguf_reference(qtype, k, n):
    raw = _gguf_raw(qtype, k, n, seed=k + n)
    p = pack_gguf(raw, qtype, (k, n))
    ref = _reference(raw, qtype, k, n)
    got = p.dequantize()
    assert got.dtype == np.float32 and got.shape == (k, n) == p.shape
    assert np.all(np.isfinite(ref))
    np.testing.assert_array_equal(got, ref)
    if qtype != "Q4_0":  # q*d + (-8d) can give +0.0 where (q-8)*d gives -0.0
        np.testing.assert_array_equal(_bits(got), _bits(ref))
    # Shapes and dtypes of the packed arrays follow the documented layout.
    assert p.codes.dtype == np.uint8
    assert p.codes.shape == ((k // 2, n) if p.bits == 4 else (k, n))
    assert p.scale.shape == (k // p.group, n)
    assert p.offset is None or (p.offset.shape == p.scale.shape and p.offset.dtype == p.scale.dtype)
    want_dtype = np.float16 if qtype in WRITABLE else np.float32
    assert p.scale.dtype == want_dtype


EXPECTED = {  # bits, group, signed, has offset
    "Q8_0": (8, 32, True, False), "Q4_0": (4, 32, False, True), "Q4_1": (4, 32, False, True),
    "Q5_0": (8, 32, True, False), "Q5_1": (8, 32, False, True), "Q2_K": (8, 16, False, True),
    "Q3_K": (8, 16, True, False), "Q4_K": (4, 32, False, True), "Q5_K": (8, 32, False, True),
    "Q6_K": (8, 16, True, False),
}


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_packing_parameters_and_bytes(qtype):
    k, n = 256, 16
    raw = _gguf_raw(qtype, k, n, seed=3)
    p = pack_gguf(raw, qtype, (k, n))
    assert (p.bits, p.group, p.signed, p.offset is not None) == EXPECTED[qtype]
    ratio = p.nbytes / raw.nbytes
    if qtype in ("Q8_0", "Q4_1"):
        assert p.nbytes == raw.nbytes
    elif qtype == "Q4_0":  # its -8*d offset costs 2 bytes per 18-byte block
        assert p.nbytes == raw.nbytes + 2 * n * (k // 32)
    if p.bits == 4:
        assert ratio <= 1.35, ratio


def test_four_bit_layout_is_documented_one():
    # Element k0 + j in the low nibble and k0 + 16 + j in the high nibble of byte k0 // 2 + j.
    k, n = 64, 3
    values = np.random.default_rng(0).integers(0, 16, size=(k, n), dtype=np.uint8)
    codes = np.zeros((k // 2, n), np.uint8)
    for k0 in range(0, k, 32):
        for j in range(16):
            codes[k0 // 2 + j] = values[k0 + j] | (values[k0 + 16 + j] << 4)
    p = PackedWeight(codes=codes, scale=np.ones((k // 32, n), np.float16), offset=None, group=32,
                     bits=4, signed=False)
    np.testing.assert_array_equal(p.int_codes(), values)
    np.testing.assert_array_equal(p.dequantize(), values.astype(np.float32))
    # Q4_0's in-block nibbles are copied unchanged (apart from the transpose).
    raw = _gguf_raw("Q4_0", 64, 3, seed=1)
    q = pack_gguf(raw, "Q4_0", (64, 3))
    qs = raw.reshape(3, 2, 18)[..., 2:].reshape(3, 32)
    np.testing.assert_array_equal(q.codes, qs.T)


def test_reader_tensor_data_packs(tmp_path):
    # Through a real file: GGUFReader's tensor.data is [N, K_bytes] uint8 for quantized types.
    k, n = 256, 8
    raws = {qtype: _gguf_raw(qtype, k, n, seed=5) for qtype in ("Q8_0", "Q4_K", "Q6_K")}
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for qtype, raw in raws.items():
        writer.add_tensor(f"w.{qtype}", raw, raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in gguf.GGUFReader(str(path)).tensors:
        qtype = t.tensor_type.name
        assert t.data.dtype == np.uint8 and t.data.shape == raws[qtype].shape
        k_file, n_file = (int(x) for x in t.shape)  # GGUF lists dims innermost first: (K, N)
        assert (k_file, n_file) == (k, n)
        p = pack_gguf(t.data, t.tensor_type, (k_file, n_file))
        np.testing.assert_array_equal(p.dequantize(), _reference(raws[qtype], qtype, k, n))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types_are_not_packed(qtype):
    with pytest.raises(ValueError, match=qtype):
        pack_gguf(np.zeros((4, 64), np.uint8), qtype, (32, 4))


def test_unsupported_type_and_bad_sizes():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        pack_gguf(np.zeros((4, 66), np.uint8), "IQ2_XXS", (256, 4))
    with pytest.raises(ValueError, match="Q8_0"):
        pack_gguf(np.zeros((4, 33), np.uint8), "Q8_0", (32, 4))  # wrong byte count
    with pytest.raises(ValueError, match="block size"):
        pack_gguf(np.zeros((4, 34), np.uint8), "Q8_0", (48, 4))


def _check_repacked(originals, repacked):
    assert len(repacked) == len(originals)
    first = repacked[0]
    for orig, new in zip(originals, repacked, strict=True):
        np.testing.assert_array_equal(_bits(new.dequantize()), _bits(orig.dequantize()))
        assert (new.bits, new.group, new.signed) == (first.bits, first.group, first.signed)
        assert new.codes.shape == first.codes.shape and new.codes.dtype == first.codes.dtype
        assert new.scale.shape == first.scale.shape and new.scale.dtype == first.scale.dtype
        assert (new.offset is None) == (first.offset is None)
        if new.offset is not None:
            assert new.offset.shape == first.offset.shape and new.offset.dtype == first.offset.dtype
    stacked = np.stack([w.codes for w in repacked])  # one array per tensor across layers
    assert stacked.shape == (len(repacked), *first.codes.shape)


def test_repack_kquant_mix():
    k, n = 256, 16
    layers = [pack_gguf(_gguf_raw(q, k, n, seed=i), q, (k, n))
              for i, q in enumerate(["Q4_K", "Q6_K", "Q8_0", "Q4_K"])]
    out = repack(layers)
    _check_repacked(layers, out)
    assert (out[0].bits, out[0].group, out[0].signed) == (8, 16, True)
    assert out[0].offset is not None and out[0].scale.dtype == np.float32


def test_repack_q4_0_q4_1_stays_four_bit():
    k, n = 512, 8
    layers = [pack_gguf(_gguf_raw(q, k, n, seed=i), q, (k, n)) for i, q in enumerate(["Q4_0", "Q4_1"])]
    out = repack(layers)
    _check_repacked(layers, out)
    assert (out[0].bits, out[0].group, out[0].signed) == (4, 32, False)
    assert out[0].scale.dtype == np.float16 and out[0].codes.shape == (k // 2, n)
    np.testing.assert_array_equal(out[0].codes, layers[0].codes)  # nibbles untouched


def test_repack_keeps_negative_zero_and_mixes_per_channel():
    k, n = 256, 8
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    w[:, 0] = -0.0  # a zero column: scale 1, codes 0 -> products are +0.0
    per_channel = quantize_int8_per_channel(w)
    per_channel.scale[0, 1] = -per_channel.scale[0, 1]  # negative scale: zero codes give -0.0
    per_channel.codes[:5, 1] = 0
    layers = [per_channel, pack_gguf(_gguf_raw("Q5_1", k, n, seed=9), "Q5_1", (k, n)),
              pack_gguf(_gguf_raw("Q2_K", k, n, seed=8), "Q2_K", (k, n))]
    assert np.signbit(layers[0].dequantize()[:5, 1]).all()
    out = repack(layers)
    _check_repacked(layers, out)
    assert (out[0].group, out[0].signed) == (16, True)
    assert np.signbit(out[0].dequantize()[:5, 1]).all()


def test_repack_refuses_inexact_mixes():
    k, n = 64, 4
    unsigned = PackedWeight(codes=np.full((k, n), 200, np.uint8), scale=np.ones((1, n), np.float32),
                            offset=None, group=k, bits=8, signed=False)
    with pytest.raises(ValueError, match="127"):
        repack([unsigned, quantize_int8_per_channel(np.ones((k, n)))])
    with pytest.raises(ValueError, match="shape"):
        repack([unsigned, quantize_int8_per_channel(np.ones((k, n + 1)))])
    assert repack([]) == []


def test_int8_per_channel_error_bound_and_round_trip():
    rng = np.random.default_rng(4)
    k, n = 256, 12
    w = rng.standard_normal((k, n)) * rng.uniform(0.01, 3.0, size=n)
    w[:, 3] = 0.0
    w[7, 5] = 0.5 * (w[7, 5] + np.abs(w[:, 5]).max())  # ties are not special-cased
    p = quantize_int8_per_channel(w)
    assert (p.bits, p.group, p.signed, p.offset) == (8, k, True, None)
    assert p.scale.shape == (1, n) and p.scale.dtype == np.float32
    expect = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    expect[3] = 1.0
    np.testing.assert_array_equal(p.scale[0], expect)
    codes = p.codes.view(np.int8)
    assert np.abs(codes.astype(int)).max() <= 127
    assert (codes[:, 3] == 0).all()
    deq = p.dequantize()
    bound = p.scale[0].astype(np.float64) / 2 * (1 + 1e-6)
    assert (np.abs(w - deq) <= bound).all()
    # Each column's largest magnitude maps to +-127.
    assert (np.abs(codes.astype(int)).max(axis=0)[[i for i in range(n) if i != 3]] == 127).all()
    # Round trip: quantizing the dequantized weight gives back the same codes and scales.
    again = quantize_int8_per_channel(deq)
    np.testing.assert_array_equal(again.codes, p.codes)
    np.testing.assert_array_equal(again.scale, p.scale)


def test_int8_rounds_half_to_even():
    w = np.array([[127.0], [0.5], [1.5], [2.5], [-0.5], [-2.5]])  # scale 1
    p = quantize_int8_per_channel(w)
    assert p.scale[0, 0] == 1.0
    np.testing.assert_array_equal(p.codes.view(np.int8)[:, 0], [127, 0, 2, 2, 0, -2])
