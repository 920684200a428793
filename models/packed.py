"""Quantized linear weights kept packed, in one layout the model dequantizes inside its jitted step.

Pure numpy (no jax): the loader packs GGUF tensors here, then moves the arrays to the device.

Representation (``PackedWeight``) of a linear weight the model uses as ``w[K, N]`` (K = input
features, N = output features).  GGUF (like torch) stores the transpose, ``[N, K]`` row-major, so
its blocks run along K inside each output row; packing transposes them so K is the leading axis.

* ``codes`` (uint8):

  - ``bits == 8``: shape ``[K, N]``, ``codes[k, n]`` is the code of element ``(k, n)``.  When
    ``signed`` the byte is an int8 in two's complement (``codes.view(np.int8)``), else a uint8.
  - ``bits == 4``: shape ``[K // 2, N]``, codes always unsigned 0..15, two per byte.  K is cut
    into groups of 32 consecutive indices; for the group starting at ``k0`` (a multiple of 32)
    and ``j`` in 0..15, byte ``codes[k0 // 2 + j, n]`` holds element ``k0 + j`` in its low nibble
    (``byte & 0xF``) and element ``k0 + 16 + j`` in its high nibble (``byte >> 4``).  This is the
    in-block order of GGUF's Q4_0/Q4_1, whose bytes are copied unchanged (apart from the
    transpose).  Q4_K orders nibbles per 64 elements instead (byte ``i`` of a 32-byte chunk holds
    elements ``i`` and ``32 + i``), so its nibbles are moved into this layout when packing.
    Unpacking: ``b = codes.reshape(K // 32, 16, N)``; ``stack([b & 15, b >> 4], axis=1)``
    reshaped to ``[K, N]``.

* ``scale`` and ``offset`` (``offset`` may be None): shape ``[K // group, N]``, same dtype, and

      w[k, n] = code(k, n) * scale[k // group, n] + (offset[k // group, n] if offset else 0)

  computed in float32 (code is the signed or unsigned integer).  ``group`` is 16 or 32 for GGUF
  types, or K for per-channel scales.  The dtype is float16 when every scale and offset value is
  exactly a float16 (the f16 ``d``/``m`` of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; Q4_0's offset ``-8*d``
  too unless it overflows float16), else float32 (K-quant products such as ``d * sc``).

Per GGUF type (bytes per 256 weights: file -> packed):

  ======  ====  =====  ======  =================================  ===========
  type    bits  group  signed  scale / offset                     bytes
  ======  ====  =====  ======  =================================  ===========
  Q8_0    8     32     yes     d (f16) / none                     272 -> 272
  Q4_0    4     32     no      d / -8*d (f16)                     144 -> 160
  Q4_1    4     32     no      d / m (f16)                        160 -> 160
  Q5_0    8     32     yes     d (f16) / none, code q - 16        176 -> 272
  Q5_1    8     32     no      d / m (f16)                        192 -> 288
  Q2_K    8     16     no      d*sc / -dmin*m (f32)                84 -> 384
  Q3_K    8     16     yes     d*(sc-32) (f32) / none             110 -> 320
  Q4_K    4     32     no      d*sc / -dmin*m (f32)               144 -> 192
  Q5_K    8     32     no      d*sc / -dmin*m (f32)               176 -> 320
  Q6_K    8     16     yes     d*sc (f32) / none, code q - 32     210 -> 320
  ======  ====  =====  ======  =================================  ===========

``dequantize()`` equals the gguf package's reference dequantizer value for value (the float32
operations are the same ones; Q4_0's ``q*d + (-8*d)`` is exact because every term is a small
multiple of d's last bit, so only the sign of a zero can differ from ``(q - 8) * d``).

``repack`` makes per-layer packings of one tensor stackable without changing any dequantized bit;
see its docstring for the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# GGUF block geometry: type -> (weights per block, bytes per block).
_BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

SUPPORTED_TYPES: tuple[str, ...] = tuple(_BLOCKS)


@dataclass
class PackedWeight:
    """A weight ``w[K, N]`` as integer codes with per-group scale (and offset); see the module doc."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int
    bits: int
    signed: bool

    def __post_init__(self) -> None:
        if self.codes.dtype != np.uint8 or self.codes.ndim != 2:
            raise ValueError(f"codes must be a 2-D uint8 array, got {self.codes.dtype} {self.codes.shape}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.bits == 4 and self.signed:
            raise ValueError("4-bit codes are unsigned")
        k, n = self.shape
        if self.group <= 0 or k % self.group:
            raise ValueError(f"group {self.group} does not divide K={k}")
        if self.bits == 4 and k % 32:
            raise ValueError(f"4-bit codes need K a multiple of 32, got K={k}")
        want = (k // self.group, n)
        if self.scale.shape != want:
            raise ValueError(f"scale has shape {self.scale.shape}, expected {want}")
        if self.scale.dtype not in (np.float16, np.float32):
            raise ValueError(f"scale dtype must be float16 or float32, got {self.scale.dtype}")
        if self.offset is not None and (self.offset.shape != want or self.offset.dtype != self.scale.dtype):
            raise ValueError(
                f"offset {self.offset.dtype} {self.offset.shape} must match scale {self.scale.dtype} {want}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)`` of the unpacked weight."""
        rows, n = self.codes.shape
        return (rows * 2 if self.bits == 4 else rows, n)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes))

    def int_codes(self) -> np.ndarray:
        """The codes as integers, shape ``[K, N]`` (int8 when signed, else uint8)."""
        if self.bits == 4:
            return _unpack_nibbles(self.codes)
        return self.codes.view(np.int8) if self.signed else self.codes

    def columns(self, index) -> PackedWeight:
        """The weight restricted to output columns ``index`` (a slice or an index array):
        blocks run along K, so any selection of columns keeps them whole (a fused
        projection's slices, a row permutation of the torch layout)."""
        take = lambda a: None if a is None else np.ascontiguousarray(a[:, index])  # noqa: E731
        return PackedWeight(take(self.codes), take(self.scale), take(self.offset), self.group,
                            self.bits, self.signed)

    def arrays(self) -> dict[str, np.ndarray]:
        """The params-tree leaves: ``codes`` (int8 when signed, else uint8), ``scale`` and, when
        present, ``offset``; the model reads bits and group back from the shapes
        (`models.qlinear`)."""
        out = {"codes": self.codes.view(np.int8) if self.signed else self.codes,
               "scale": self.scale}
        if self.offset is not None:
            out["offset"] = self.offset
        return out

    def dequantize(self) -> np.ndarray:
        """float32 ``[K, N]``: ``code * scale + offset`` per element."""
        w = self.int_codes().astype(np.float32)
        w *= np.repeat(self.scale.astype(np.float32), self.group, axis=0)
        if self.offset is not None:
            w += np.repeat(self.offset.astype(np.float32), self.group, axis=0)
        return w


# ---------------------------------------------------------------------------------------------
# nibble layout helpers


def _unpack_nibbles(codes: np.ndarray) -> np.ndarray:
    """``[K // 2, N]`` packed (module layout) -> ``[K, N]`` uint8 values 0..15."""
    half, n = codes.shape
    b = codes.reshape(half // 16, 16, n)
    return np.stack([b & 0xF, b >> 4], axis=1).reshape(half * 2, n)


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """``[K, N]`` values 0..15 -> ``[K // 2, N]`` packed (module layout)."""
    k, n = values.shape
    v = values.astype(np.uint8).reshape(k // 32, 2, 16, n)
    return (v[:, 0] | (v[:, 1] << 4)).reshape(k // 2, n)


# ---------------------------------------------------------------------------------------------
# GGUF block parsing.  Every parser takes ``blocks`` of shape [N, n_blocks, block_bytes] and
# returns (codes [N, K] or packed nibbles [N, K // 2], scale [N, G], offset [N, G] | None) with
# the float arrays in float32 (narrowed to float16 later when exact).


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian float16 at byte ``at`` of every block, as float32 ``[N, n_blocks]``."""
    pair = np.ascontiguousarray(blocks[..., at : at + 2])
    return pair.view("<f2")[..., 0].astype(np.float32)


def _flat(x: np.ndarray) -> np.ndarray:
    """[N, n_blocks, ...] -> [N, -1] in block order."""
    return x.reshape(x.shape[0], -1)


def _bits_of(bytes_: np.ndarray, count: int) -> np.ndarray:
    """[..., L] bytes -> [..., count, L]: bit ``s`` of byte ``i`` at ``[..., s, i]``."""
    shifts = np.arange(count, dtype=np.uint8)[:, None]
    return (bytes_[..., None, :] >> shifts) & 1


def _crumbs(bytes_: np.ndarray) -> np.ndarray:
    """[..., L] bytes -> [..., 4, L]: 2-bit field ``s`` (bits 2s..2s+1) of byte ``i`` at ``[..., s, i]``."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return (bytes_[..., None, :] >> shifts) & 3


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte field -> (sc, m), each [N, n_blocks, 8] of 6-bit values.

    Sub-blocks 0..3: sc = byte[i] & 63, m = byte[4 + i] & 63.  Sub-blocks 4..7: the low 4 bits
    sit in byte[8 + i - 4] (sc low nibble, m high nibble), the top 2 bits in the top 2 bits of
    byte[i - 4] (sc) and byte[i] (m).
    """
    lo_sc, lo_m, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (mix & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def _parse_q8_0(b):
    return _flat(b[..., 2:34]), _f16(b, 0), None


def _parse_q4_0(b):
    d = _f16(b, 0)
    return _flat(b[..., 2:18]), d, np.float32(-8) * d


def _parse_q4_1(b):
    return _flat(b[..., 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 5-bit values [N, n_blocks, 32]: low nibble from qs (byte j: elements j, 16 + j),
    bit 4 of element i is bit i of the little-endian uint32 qh."""
    low = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    high = np.swapaxes(_bits_of(qh, 8), -1, -2).reshape(low.shape)  # element 8 * byte + bit
    return low | (high << 4)


def _parse_q5_0(b):
    q = _q5_values(b[..., 2:6], b[..., 6:22]).astype(np.int8) - np.int8(16)
    return _flat(q.view(np.uint8)), _f16(b, 0), None


def _parse_q5_1(b):
    q = _q5_values(b[..., 4:8], b[..., 8:24])
    return _flat(q), _f16(b, 0), _f16(b, 2)


def _parse_q2_k(b):
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    # qs: two halves of 32 bytes; element 128 h + 32 s + i is field s of byte 32 h + i.
    q = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32))
    scale = d[..., None] * (sc & 0xF).astype(np.float32)
    offset = -(dmin[..., None] * (sc >> 4).astype(np.float32))
    return _flat(q), _flat(scale), _flat(offset)


def _parse_q3_k(b):
    hmask, qs, packed = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    d = _f16(b, 108)
    low = _crumbs(qs.reshape(*qs.shape[:-1], 2, 32)).reshape(*qs.shape[:-1], 256)
    hbit = _bits_of(hmask, 8).reshape(low.shape)  # element 32 s + i is bit s of hmask[i]
    q = low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    # 16 6-bit scales: low nibbles from bytes 0..7 (entries 0..7 low, 8..15 high nibble),
    # top 2 bits of entry t from byte 8 + t % 4 at bit 2 * (t // 4).
    lo = np.concatenate([packed[..., 0:8] & 0xF, packed[..., 0:8] >> 4], axis=-1)
    hi = _crumbs(packed[..., 8:12]).reshape(lo.shape)
    sc = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    scale = d[..., None] * sc.astype(np.float32)
    return _flat(q.view(np.uint8)), _flat(scale), None


def _k_scale_offset(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[..., 4:16])
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * m.astype(np.float32))
    return _flat(scale), _flat(offset)


def _parse_q4_k(b):
    # qs: 4 chunks of 32 bytes; byte i of chunk c holds element 64c + i (low) and 64c + 32 + i
    # (high).  Regroup into the module layout: for each 32-group, bytes j and 16 + j of the chunk.
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 2, 16)
    first, second = qs[..., 0, :], qs[..., 1, :]  # chunk bytes j and 16 + j
    even = (first & 0xF) | ((second & 0xF) << 4)  # group 2c: elements 64c + j, 64c + 16 + j
    odd = (first >> 4) | (second & 0xF0)  # group 2c + 1: elements 64c + 32 + j, 64c + 48 + j
    codes = np.stack([even, odd], axis=-2)
    return (_flat(codes), *_k_scale_offset(b))


def _parse_q5_k(b):
    qh, qs = b[..., 16:48], b[..., 48:176]
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    low = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 256)
    high = _bits_of(qh, 8).reshape(low.shape)  # element 32 s + i is bit s of qh[i]
    return (_flat(low | (high << 4)), *_k_scale_offset(b))


def _parse_q6_k(b):
    ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
    d = _f16(b, 208)
    lead = b.shape[:-1]
    # Halves of 128 elements.  ql: byte i of the half's 64 bytes holds element i (low nibble) and
    # 64 + i (high); qh: field s of byte i of the half's 32 bytes is the top 2 bits of 32 s + i.
    ql = ql.reshape(*lead, 2, 64)
    low = np.stack([ql & 0xF, ql >> 4], axis=-2).reshape(*lead, 256)
    high = _crumbs(qh.reshape(*lead, 2, 32)).reshape(*lead, 256)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scale = d[..., None] * sc.view(np.int8).astype(np.float32)
    return _flat(q.view(np.uint8)), _flat(scale), None


# type -> (parser, bits, group, signed, scale/offset may be float16)
_PARSERS = {
    "Q8_0": (_parse_q8_0, 8, 32, True, True),
    "Q4_0": (_parse_q4_0, 4, 32, False, True),
    "Q4_1": (_parse_q4_1, 4, 32, False, True),
    "Q5_0": (_parse_q5_0, 8, 32, True, True),
    "Q5_1": (_parse_q5_1, 8, 32, False, True),
    "Q2_K": (_parse_q2_k, 8, 16, False, False),
    "Q3_K": (_parse_q3_k, 8, 16, True, False),
    "Q4_K": (_parse_q4_k, 4, 32, False, False),
    "Q5_K": (_parse_q5_k, 8, 32, False, False),
    "Q6_K": (_parse_q6_k, 8, 16, True, False),
}


def _exact_f16(x: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.array_equal(x.astype(np.float16).astype(np.float32), x, equal_nan=True))


def pack_gguf(raw: np.ndarray, qtype, shape_kn: tuple[int, int]) -> PackedWeight:
    """Pack one GGUF tensor's raw bytes (``ReaderTensor.data``: uint8 ``[N, K_bytes]`` for quantized
    types; any shape with the right byte count is accepted) as a ``PackedWeight`` for ``w[K, N]``.

    ``qtype`` is the GGML type name (``"Q4_K"``) or a ``GGMLQuantizationType``.  Float types and
    unsupported quantizations raise ValueError naming the type.
    """
    name = getattr(qtype, "name", qtype)
    if not isinstance(name, str):
        raise ValueError(f"unknown GGUF type {qtype!r}")
    name = name.upper()
    if name in _FLOAT_TYPES:
        raise ValueError(f"GGUF type {name} is a float type, not packed; load it as floats")
    if name not in _PARSERS:
        raise ValueError(
            f"GGUF type {name} is not supported for packed weights (supported: {SUPPORTED_TYPES})"
        )
    k, n = (int(x) for x in shape_kn)
    block_elems, block_bytes = _BLOCKS[name]
    if k <= 0 or n <= 0 or k % block_elems:
        raise ValueError(f"{name}: K={k} must be a positive multiple of the block size {block_elems}")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    want = n * (k // block_elems) * block_bytes
    if data.size != want:
        raise ValueError(f"{name}: {data.size} bytes given, [{n}, {k}] needs {want}")
    parse, bits, group, signed, may_f16 = _PARSERS[name]
    codes, scale, offset = parse(data.reshape(n, k // block_elems, block_bytes))
    floats = [scale] if offset is None else [scale, offset]
    dtype = np.float16 if may_f16 and all(_exact_f16(x) for x in floats) else np.float32
    return PackedWeight(
        codes=np.ascontiguousarray(codes.T).astype(np.uint8, copy=False),
        scale=np.ascontiguousarray(scale.T.astype(dtype)),
        offset=None if offset is None else np.ascontiguousarray(offset.T.astype(dtype)),
        group=group,
        bits=bits,
        signed=signed,
    )


def repack(weights: list[PackedWeight], same_shape: bool = True) -> list[PackedWeight]:
    """Make per-layer packings of one tensor uniform so their arrays stack; no dequantized bit changes.

    ``same_shape=False``: weights of different widths (the members of a fused projection,
    whose arrays concatenate along N) get the same format without the shape check.

    * bits: 4 only if every weight is 4-bit, else 4-bit codes are unpacked to one byte each.
    * group: the smallest; larger groups (which must be multiples of it) repeat their rows.
    * signedness: signed if any weight is signed.  Unsigned codes join by reinterpretation: a code
      value 0..127 is the same integer as an int8, so codes, scale and offset are unchanged and
      the arithmetic is identical.  Every unsigned code ``pack_gguf`` makes is at most 31 (4-bit
      codes at most 15), so this always applies to GGUF weights; an unsigned code above 127 next
      to a signed weight raises ValueError, because folding ``128 * scale`` into the offset would
      round.  (Signed-to-unsigned folding is never used for the same reason.)
    * offset: present if any weight has one; the others get ``-0.0``, since ``x + (-0.0) == x``
      bit for bit for every float (``+0.0`` would turn a ``-0.0`` product into ``+0.0``).
    * scale/offset dtype: float32 if any is float32 (float16 -> float32 is exact), else float16.
    """
    if not weights:
        return []
    shapes = {w.shape for w in weights}
    if same_shape and len(shapes) != 1:
        raise ValueError(f"cannot repack weights of different shapes {sorted(shapes)}")
    bits = 4 if all(w.bits == 4 for w in weights) else 8
    group = min(w.group for w in weights)
    bad = [w.group for w in weights if w.group % group]
    if bad:
        raise ValueError(f"groups {bad} are not multiples of the smallest group {group}")
    signed = bits == 8 and any(w.signed for w in weights)
    has_offset = any(w.offset is not None for w in weights)
    dtype = np.float32 if any(w.scale.dtype == np.float32 for w in weights) else np.float16

    out = []
    for w in weights:
        if bits == 4:
            codes = w.codes
        else:
            values = w.int_codes()
            if signed and not w.signed and values.size and int(values.max()) > 127:
                raise ValueError(
                    "an unsigned 8-bit code above 127 cannot join signed codes exactly; "
                    "folding 128 * scale into the offset would round"
                )
            codes = np.ascontiguousarray(values).view(np.uint8)
        reps = w.group // group
        scale = np.repeat(w.scale, reps, axis=0).astype(dtype)
        if w.offset is not None:
            offset = np.repeat(w.offset, reps, axis=0).astype(dtype)
        elif has_offset:
            offset = np.full(scale.shape, -0.0, dtype=dtype)
        else:
            offset = None
        out.append(
            PackedWeight(codes=codes, scale=scale, offset=offset, group=group, bits=bits, signed=signed)
        )
    return out


def quantize_int8_per_channel(w: np.ndarray) -> PackedWeight:
    """Symmetric int8 per output channel: ``scale[n] = max|w[:, n]| / 127`` (float32, 1 for an
    all-zero column), codes ``round_half_even(w / scale)`` clipped to +-127, no offset, group K."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a [K, N] matrix, got shape {w.shape}")
    w64 = w.astype(np.float64)
    if not np.all(np.isfinite(w64)):
        raise ValueError("cannot quantize non-finite weights")
    amax = np.max(np.abs(w64), axis=0, keepdims=True) if w.shape[0] else np.zeros((1, w.shape[1]))
    scale = (amax / 127.0).astype(np.float32)
    scale[scale == 0] = 1.0
    codes = np.clip(np.rint(w64 / scale.astype(np.float64)), -127, 127).astype(np.int8)
    return PackedWeight(
        codes=codes.view(np.uint8), scale=scale, offset=None, group=w.shape[0], bits=8, signed=True
    )
