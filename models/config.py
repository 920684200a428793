"""Model configuration: one dataclass filled from an HF `config.json` or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)


class ModelConfigError(ValueError):
    """A config field is missing, malformed or names an unsupported architecture."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    Frozen and hashable so it can be a static argument of jitted functions.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling; None means the default rotary embedding.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies of the rotary embedding, with Llama-3 scaling applied if configured."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return inv_freq.astype(np.float32)
        if kind != "llama3":
            raise ModelConfigError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3")
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        return scaled.astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = tuple(sorted(d["rope_scaling"].items()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type != "llama" and "LlamaForCausalLM" not in archs:
            raise ModelConfigError(
                f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ModelConfigError(f"config.json is missing required field {key!r}")
            return hf[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        theta = hf.get("rope_theta")
        if isinstance(scaling, dict):
            theta = scaling.get("rope_theta", theta)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if kind == "default" else tuple(
                sorted((k, v) for k, v in scaling.items() if k != "rope_theta"))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> LlamaConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        return cls.from_hf(json.loads(cfg_path.read_text()))
