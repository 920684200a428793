"""Rotary position embeddings and the frequency-scaling variants the supported families use:
linear, dynamic NTK, YaRN, Llama 3 and LongRoPE (Phi-3's "su"/"longrope").

Frequencies follow HF transformers' definitions (checked against HF's own functions by the
goldens in `tests/data/family_goldens.json`). Two variants depend on the sequence length in
HF, which recomputes them per forward pass from the longest position in the batch. A paged
engine caches K already rotated, so here they depend on each token's own position instead:

- dynamic NTK: a token at position p uses the base HF would use for a sequence of
  ``max(p + 1, max_position_embeddings)`` tokens, so everything inside the original context
  is plain rotary, as in HF;
- LongRoPE: a token past ``original_max_position_embeddings`` uses the long factors, earlier
  tokens the short ones (HF switches every token of a sequence once it grows past that length).

`cos`/`sin` carry the variant's attention factor (YaRN's mscale, LongRoPE's sqrt term), as HF
applies it.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

KINDS = ("linear", "dynamic", "yarn", "llama3", "longrope")


def _kind(scaling: dict[str, Any]) -> str:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind


def freeze(scaling: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Hashable form of an HF rope_scaling dict (lists become tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


def validate(scaling: tuple[tuple[str, Any], ...] | None) -> None:
    from models.config import ModelConfigError

    if not scaling:
        return
    s = dict(scaling)
    kind = _kind(s)
    if kind == "default":
        return
    if kind not in KINDS:
        raise ModelConfigError(f"unsupported rope_scaling type {kind!r}; supported: default, "
                               f"{', '.join(KINDS)}")
    need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
            "llama3": ("factor",), "longrope": ("short_factor", "long_factor")}[kind]
    for key in need:
        if s.get(key) is None:
            raise ModelConfigError(f"rope_scaling type {kind!r} needs {key!r}")


def _default(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _original_max(s: dict[str, Any], max_pos: int) -> int:
    return int(s.get("original_max_position_embeddings") or max_pos)


def _yarn(dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
    factor = float(s["factor"])
    old = _original_max(s, max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    base = _default(dim, theta)
    return base / factor * (1 - extrapolate) + base * extrapolate, float(attn)


def _llama3(dim: int, theta: float, s: dict[str, Any]) -> np.ndarray:
    inv = _default(dim, theta)
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def _longrope_attention(s: dict[str, Any], max_pos: int) -> float:
    old = _original_max(s, max_pos)
    factor = s.get("factor")
    if s.get("original_max_position_embeddings") or factor is None:
        factor = max_pos / old  # HF's rule when the original length is given
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    return float(attn)


def inv_freq(dim: int, theta: float, scaling, max_pos: int) -> np.ndarray:
    """float32 inverse frequencies at short lengths (dynamic NTK: plain; LongRoPE: short factors)."""
    s = dict(scaling or ())
    kind = _kind(s) if s else "default"
    if kind == "linear":
        out = _default(dim, theta) / float(s["factor"])
    elif kind == "yarn":
        out = _yarn(dim, theta, s, max_pos)[0]
    elif kind == "llama3":
        out = _llama3(dim, theta, s)
    elif kind == "longrope":
        out = _default(dim, theta) / np.asarray(s["short_factor"], np.float64)
    else:
        out = _default(dim, theta)
    return out.astype(np.float32)


def attention_factor(scaling, max_pos: int) -> float:
    s = dict(scaling or ())
    kind = _kind(s) if s else "default"
    if kind == "yarn":
        return _yarn(2, 10000.0, s, max_pos)[1]  # the factor does not depend on dim/theta
    if kind == "longrope":
        return _longrope_attention(s, max_pos)
    return 1.0


def tables(positions, dim: int, theta: float, scaling, max_pos: int):
    """cos/sin ``[..., dim / 2]`` (fp32) for integer positions, attention factor applied."""
    s = dict(scaling or ())
    kind = _kind(s) if s else "default"
    pos = positions.astype(jnp.float32)[..., None]
    if kind == "dynamic":
        factor = float(s["factor"])
        seq = jnp.maximum(pos + 1, float(max_pos))
        ratio = factor * seq / max_pos - (factor - 1)  # base multiplier ** ((dim - 2) / dim)
        expo = jnp.asarray(np.arange(0, dim, 2) / (dim - 2), jnp.float32)
        angles = pos * jnp.asarray(_default(dim, theta), jnp.float32) * ratio ** -expo
    elif kind == "longrope":
        old = _original_max(s, max_pos)
        short = jnp.asarray(inv_freq(dim, theta, scaling, max_pos))
        long = jnp.asarray((_default(dim, theta) / np.asarray(s["long_factor"], np.float64))
                           .astype(np.float32))
        angles = pos * jnp.where(pos + 1 > old, long, short)
    else:
        angles = pos * jnp.asarray(inv_freq(dim, theta, scaling, max_pos))
    attn = attention_factor(scaling, max_pos)
    return jnp.cos(angles) * attn, jnp.sin(angles) * attn
