"""Model configuration: one dataclass for every decoder family, filled from an HF
`config.json` or GGUF metadata.

The families share one functional core (`models.decoder`); what differs between them is a
handful of switches here: biases on the q/k/v projections (Qwen2), per-head q/k RMSNorm
(Qwen3, Gemma 3), Gemma's sandwich norms, scaled embeddings, GELU and logit soft-capping,
per-layer sliding windows (Mistral, Phi-3, Gemma 2/3), a second rotary base for local layers
(Gemma 3), partial rotary dimensions, and routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE).
Each `from_hf` family reader maps its config.json fields onto those switches and refuses the
fields it cannot honour by name, rather than serving a model that silently differs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from models import rope

# model_type values accepted from config.json (GGUF general.architecture names map onto them
# in `models.gguf_loader`).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                           "mixtral", "qwen2_moe", "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_tanh")


class ModelConfigError(ValueError):
    """A config field is missing, malformed or names an unsupported architecture."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only transformer.

    Frozen and hashable so it can be a static argument of jitted functions. Defaults are
    Llama's; every family switch is off unless its reader turns it on.
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
    # Frequency scaling as HF's rope_scaling dict (sorted items); None: plain rotary.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # --- attention variants
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    # Softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    attn_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    # Per-layer sliding window in tokens (a query sees itself and the window - 1 tokens
    # before it); 0 = full attention. Empty: every layer is full.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # rotary base of windowed layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # fraction of each head that is rotated
    # --- block variants
    hidden_act: str = "silu"
    sandwich_norm: bool = False  # Gemma 2/3: norms after attention and MLP as well
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    final_softcap: float | None = None  # LM-head logit soft-capping (Gemma 2)
    # --- mixture of experts (num_experts == 0: dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (sigmoid-gated)

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
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} not supported; supported: {ACTIVATIONS}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelConfigError(f"layer_windows has {len(self.layer_windows)} entries for "
                                   f"{self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ModelConfigError("layer_windows entries must be >= 0 (0 = full attention)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must give an "
                                   f"even rotary dimension in (0, head_dim={self.head_dim}]")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                       f"1..num_experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ModelConfigError("moe_intermediate_size must be positive for an MoE model")
        rope.validate(self.rope_scaling)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def windows(self) -> tuple[int, ...]:
        """Sliding window of every layer (0 = full attention)."""
        return self.layer_windows or (0,) * self.num_layers

    @property
    def max_window(self) -> int:
        """The widest window when every layer is windowed, else 0: tokens further back than
        this are never read again, so their KV blocks can be freed."""
        ws = self.windows
        return max(ws) if all(ws) else 0

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies of the (global layers') rotary embedding, scaling applied."""
        return rope.inv_freq(self.rotary_dim, self.rope_theta, self.rope_scaling,
                             self.max_position_embeddings)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        for key in ("eos_token_ids", "layer_windows"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = rope.freeze(d["rope_scaling"])
        for key in ("eos_token_ids", "layer_windows"):
            d[key] = tuple(d.get(key) or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (old and v5 field layouts)."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type == "gemma3_text":
            model_type = "gemma3"
        elif model_type == "gemma3":
            raise ModelConfigError("gemma3 multimodal checkpoints are not supported; "
                                   "use the text-only model (model_type gemma3_text)")
        if model_type is None and "LlamaForCausalLM" in archs:
            model_type = "llama"
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                f"supported: {SUPPORTED_ARCHITECTURES}")
        return cls(**_read_hf(model_type, hf))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        config = cls.from_hf(json.loads(cfg_path.read_text()))
        gen = path / "generation_config.json"
        if gen.is_file():  # its eos list (chat models stop on several ids) wins
            eos = _eos_ids(json.loads(gen.read_text()).get("eos_token_id"))
            if eos:
                config = dataclasses.replace(
                    config, eos_token_ids=tuple(dict.fromkeys(eos + config.eos_token_ids)))
        return config


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _read_hf(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `ModelConfig` for one family's config.json."""

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ModelConfigError(f"config.json is missing required field {key!r}")
        return hf[key]

    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    num_layers = int(need("num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    if hf.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=true is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}.get(act)
    if act is None:
        raise ModelConfigError(f"hidden activation {hf.get('hidden_act')!r} not supported; "
                               f"supported: silu, gelu_pytorch_tanh")

    # Rotary parameters: old layout (rope_theta + rope_scaling) or v5 rope_parameters, which
    # Gemma 3 keys by layer type.
    params = hf.get("rope_parameters")
    local_theta = hf.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:
        local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
        params = params["full_attention"]
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta")
    partial = float(hf.get("partial_rotary_factor") or 1.0)
    if isinstance(scaling, dict):
        theta = scaling.get("rope_theta", theta)
        partial = float(scaling.get("partial_rotary_factor", partial))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        extra = {k: v for k, v in scaling.items()
                 if k not in ("rope_theta", "partial_rotary_factor")}
        if kind in ("longrope", "su") and "original_max_position_embeddings" not in extra \
                and hf.get("original_max_position_embeddings"):
            extra["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling = None if kind == "default" else rope.freeze(extra)

    out: dict[str, Any] = dict(
        architecture=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        # MoE families without dense layers may omit it; the experts' width is what counts.
        intermediate_size=int(hf.get("intermediate_size") or hf.get("moe_intermediate_size")
                              if family in ("qwen2_moe", "qwen3_moe")
                              else need("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if family.startswith("gemma") else 1e-5)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                        family.startswith("gemma"))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        hidden_act=act,
        partial_rotary_factor=partial,
    )
    bias = bool(hf.get("attention_bias", False))
    out["qkv_bias"] = bias or family in ("qwen2", "qwen2_moe")
    out["o_bias"] = bias and family not in ("qwen2", "qwen2_moe")
    out["qk_norm"] = family in ("qwen3", "qwen3_moe", "gemma3")
    out["layer_windows"] = _layer_windows(family, hf, num_layers)
    if family.startswith("gemma"):
        out.update(sandwich_norm=True, embed_scale=True,
                   attn_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                   attn_softcap=hf.get("attn_logit_softcapping"),
                   final_softcap=hf.get("final_logit_softcapping"))
        if family == "gemma3":
            out["rope_local_theta"] = float(local_theta or 10000.0)
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError("use_bidirectional_attention=true is not supported")
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        out.update(_read_moe(family, hf))
    return out


def _layer_windows(family: str, hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not hf.get("use_sliding_window"):
        return ()
    if not window:
        return ()
    types = hf.get("layer_types")
    if types is None:
        if family == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(num_layers)]
        elif family == "gemma3":
            pattern = int(hf.get("sliding_window_pattern") or 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(num_layers)]
        elif family.startswith("qwen"):
            start = int(hf.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= start else "full_attention"
                     for i in range(num_layers)]
        else:  # Mistral, Mixtral, Phi-3: every layer
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelConfigError(f"layer_types {sorted(unknown)} not supported")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _read_moe(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    if family == "mixtral":
        experts, inter = hf.get("num_local_experts"), hf.get("intermediate_size")
        norm = True
    else:
        # transformers v5 writes num_local_experts for the Qwen MoE families too
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        inter = hf.get("moe_intermediate_size")
        norm = bool(hf.get("norm_topk_prob", False))
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ModelConfigError("mlp_only_layers / decoder_sparse_step != 1 (dense layers "
                                   "between MoE layers) are not supported")
    if not experts or not inter:
        raise ModelConfigError(f"{family} config is missing its expert count or size")
    if hf.get("router_jitter_noise"):
        raise ModelConfigError("router_jitter_noise is a training option; set it to 0")
    return dict(num_experts=int(experts), num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(inter), norm_topk_prob=norm,
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
                if family == "qwen2_moe" else 0)
