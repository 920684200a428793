"""Load a llama.cpp GGUF file: config from metadata, tensors dequantized to floats.

The metadata is turned into the HF `config.json` fields it stands for and read by
`ModelConfig.from_hf`, so each family's switches are decided in one place. llama.cpp's
converter permutes the rows of Q and K of Llama-architecture files so that its rotary kernel
can rotate adjacent pairs; our model (like HF) rotates halves, so those rows are permuted back
here. Other architectures are stored unpermuted (llama.cpp rotates them NeoX-style). Gemma's
norm weights are stored as ``1 + w``, which is what the model keeps.

Families llama.cpp writes under another name: Mistral and Mixtral are ``llama`` files (with
``llama.attention.sliding_window`` / ``llama.expert_count``); Phi-3 keeps its fused
``attn_qkv`` and ``ffn_up`` (gate rows first) tensors and its LongRoPE factors as the tensors
``rope_factors_long/short.weight``; MoE files stack the experts of a layer in one tensor
(``ffn_{gate,up,down}_exps``, numpy shape ``[experts, out, in]``), which is served here one
expert at a time under the per-expert HF names.

Rotary scaling: ``yarn`` keys become HF's yarn rope_scaling, Llama 3's ``rope_freqs.weight``
divisors its llama3 parameters. A file's EOS is joined by its end-of-turn tokens (eot/eom ids,
<|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>), which llama.cpp stops on too.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, ModelConfigError
from models.packed import SUPPORTED_TYPES as PACKED_TYPES
from models.packed import pack_gguf
from models.weights import WeightError, assemble_params

# Quantization types we dequantize (with the gguf package's reference dequantizers);
# anything else is refused by name.
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                         "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture -> HF model_type
# (``llama`` files are Mistral with a sliding window and Mixtral with experts.)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2",
                      "gemma3": "gemma3_text"}
# Architectures whose every layer is MoE; their expert metadata is required.
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")
# llama.cpp's router weights: Llama (Mixtral) and Qwen3-MoE renormalise the top-k weights,
# Qwen2-MoE does not (unless {arch}.expert_weights_norm says so).
MOE_NORM_TOPK_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True}

GGUF_TO_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's sandwich norms: ffn_norm is the norm *before* the MLP there.
GGUF_TO_HF_GEMMA = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused projections, under HF Phi-3's names (split by `canonical_getter`).
GGUF_TO_HF_PHI3 = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
GGUF_TO_HF_MOE = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Stacked experts [E, out, in] -> the per-expert HF projection they hold.
GGUF_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}
GGUF_TO_HF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    if name in GGUF_TO_HF_GLOBAL:
        return GGUF_TO_HF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    table = {**GGUF_TO_HF_LAYER, **GGUF_TO_HF_MOE}
    if arch.startswith("gemma"):
        table.update(GGUF_TO_HF_GEMMA)
    elif arch == "phi3":
        table.update(GGUF_TO_HF_PHI3)
    if parts[2] in GGUF_EXPERTS:  # a stacked tensor: {e} is filled in per expert
        return f"model.layers.{parts[1]}.mlp.experts.{{e}}.{GGUF_EXPERTS[parts[2]]}.weight"
    return f"model.layers.{parts[1]}.{table[parts[2]]}" if parts[2] in table else None


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_config_from_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF `config.json` fields the GGUF metadata describes."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture {arch!r} in GGUF general.architecture; "
            f"supported: {tuple(GGUF_ARCHITECTURES)}")

    def meta(key: str) -> Any:
        return field_value(reader, f"{arch}.{key}")

    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise ModelConfigError(f"GGUF metadata is missing {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelConfigError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer tokens")
        vocab = len(tokens.data)
    names = {t.name for t in reader.tensors}
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    rope_dims = meta("rope.dimension_count")
    if arch == "phi3":  # no key_length; rope.dimension_count is the rotated part of a head
        head_dim = int(meta("attention.key_length") or hidden // num_heads)
    else:
        head_dim = int(meta("attention.key_length") or rope_dims or hidden // num_heads)
    experts = meta("expert_count")
    if arch in MOE_ARCHITECTURES or (experts is None and "blk.0.ffn_gate_inp.weight" in names):
        experts = need("expert_count")
    moe = bool(experts)
    model_type = GGUF_ARCHITECTURES[arch]
    window = meta("attention.sliding_window")
    if arch == "llama" and moe:
        model_type = "mixtral"
    elif arch == "llama" and window:
        model_type = "mistral"
    hf: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length") if arch not in MOE_ARCHITECTURES
                                 else meta("feed_forward_length")
                                 or need("expert_feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon") or 1e-5),
        "rope_theta": float(meta("rope.freq_base") or 10000.0),
        "max_position_embeddings": int(meta("context_length") or 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": int(eos) if eos is not None else None,
    }
    if moe:
        hf.update(_moe_config(arch, meta, need, int(experts),
                              shared="blk.0.ffn_gate_shexp.weight" in names))
    if arch in ("llama", "phi3") and window:  # Mistral, Mixtral, Phi-3: every layer
        hf["sliding_window"] = int(window)  # (llama.cpp writes 0 for Phi-4: no window)
    if arch == "phi3":
        if rope_dims and int(rope_dims) != head_dim:
            hf["partial_rotary_factor"] = int(rope_dims) / head_dim
        longrope = _phi3_longrope(reader, meta, need)
        if longrope:
            hf["rope_scaling"] = longrope
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "yarn":
        hf["rope_scaling"] = _yarn(arch, meta, need)
    elif arch == "llama" and "rope_freqs.weight" in names:
        llama3 = _llama3_from_freqs(reader, meta, hf["rope_theta"], rope_dims or head_dim)
        if llama3:
            hf["rope_scaling"] = llama3
    elif arch == "llama" and scaling_type == "llama3":
        factor = meta("rope.scaling.factor")
        if factor is None:
            raise ModelConfigError("llama3 rope scaling without llama.rope.scaling.factor")
        hf["rope_scaling"] = {
            "rope_type": "llama3", "factor": float(factor),
            "low_freq_factor": float(meta("rope.scaling.low_freq_factor") or 1.0),
            "high_freq_factor": float(meta("rope.scaling.high_freq_factor") or 4.0),
            "original_max_position_embeddings": int(
                meta("rope.scaling.original_context_length") or 8192)}
    elif scaling_type == "linear" and meta("rope.scaling.factor"):
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if arch.startswith("gemma"):
        # llama.cpp scales queries by head_dim ** -0.5 for these files (Gemma 3 27B aside).
        hf["query_pre_attn_scalar"] = head_dim
        hf["sliding_window"] = meta("attention.sliding_window")
        hf["attn_logit_softcapping"] = meta("attn_logit_softcapping")
        hf["final_logit_softcapping"] = meta("final_logit_softcapping")
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        pattern = meta("attention.sliding_window_pattern")
        if isinstance(pattern, int):
            hf["sliding_window_pattern"] = pattern
    stops = _end_of_turn_ids(reader)
    if eos is not None and stops:
        hf["eos_token_id"] = list(dict.fromkeys([int(eos), *stops]))
    return hf


# Tokens that end a chat turn in the supported families' templates. A file often lists only
# the end-of-text token as EOS (HF keeps the others in generation_config.json); llama.cpp
# stops on these by their text too.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def _end_of_turn_ids(reader: gguf.GGUFReader) -> list[int]:
    """``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` and the vocabulary's end-of-turn
    tokens (Llama 3's <|eot_id|>, ChatML's <|im_end|>, Phi-3's <|end|>, Gemma's <end_of_turn>)."""
    out = [int(v) for key in ("eot_token_id", "eom_token_id")
           if (v := field_value(reader, f"tokenizer.ggml.{key}")) is not None]
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TOKENS}
    return out + [index[t] for t in END_OF_TURN_TOKENS if t in index]


def _yarn(arch: str, meta, need) -> dict[str, Any]:
    """HF's yarn rope_scaling from llama.cpp's keys (its converter renames HF's: attention_factor
    -> yarn_attn_factor, beta_fast/slow -> yarn_beta_fast/slow). ``yarn_log_multiplier`` is read
    as llama.cpp reads it: HF's mscale_all_dim, with mscale 1."""
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor"))}
    orig = meta("rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                      ("yarn_beta_slow", "beta_slow")):
        value = meta(f"rope.scaling.{key}")
        if value is not None:
            out[name] = float(value)
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    if log_mul:
        out.update(mscale=1.0, mscale_all_dim=float(log_mul))
    ext = meta("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:  # HF's YaRN has no such knob (it is 1 there)
        raise ModelConfigError(f"{arch}.rope.scaling.yarn_ext_factor={ext} is not supported "
                               "(only 1.0, HF's YaRN ramp)")
    return out


def _llama3_from_freqs(reader: gguf.GGUFReader, meta, theta: float,
                       dim: int) -> dict[str, Any] | None:
    """HF's llama3 rope_scaling behind llama.cpp's ``rope_freqs.weight`` (the per-dimension
    divisors of the inverse frequencies, which its converter writes instead of the parameters).
    The factor is the largest divisor; low/high_freq_factor come from metadata or Llama 3.1's
    1 and 4, and the original context is solved from a blended dimension (8192 for Llama 3.x).
    The result must reproduce the tensor; None when it scales nothing."""
    from models import rope

    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    divisors = dequantize(tensor).reshape(-1).astype(np.float64)
    if divisors.shape != (dim // 2,):
        raise ModelConfigError(f"rope_freqs.weight has {divisors.size} entries, expected {dim // 2}")
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0):
        return None
    low = float(meta("rope.scaling.low_freq_factor") or 1.0)
    high = float(meta("rope.scaling.high_freq_factor") or 4.0)
    old = float(meta("rope.scaling.original_context_length") or 8192)
    base = rope._default(dim, theta)
    blended = np.flatnonzero((divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4)))
    if blended.size:  # 1 / d = (1 - s) / factor + s, s = (old / wavelength - low) / (high - low)
        i = int(blended[0])
        smooth = (1 / divisors[i] - 1 / factor) / (1 - 1 / factor)
        old = 2 * np.pi / base[i] * (low + smooth * (high - low))
    out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
           "high_freq_factor": high, "original_max_position_embeddings": int(round(old))}
    if not np.allclose(base / rope._llama3(dim, theta, out), divisors, rtol=1e-4):
        raise ModelConfigError("rope_freqs.weight does not follow Llama 3's rope scaling rule "
                               f"(factor {factor}, low/high_freq_factor {low}/{high})")
    return out


def _moe_config(arch: str, meta, need, experts: int, shared: bool) -> dict[str, Any]:
    """The HF expert fields: Mixtral's names for ``llama`` files, Qwen-MoE's for the others."""
    gating = meta("expert_gating_func")
    if gating is not None and int(gating) != int(gguf.ExpertGatingFuncType.SOFTMAX):
        raise ModelConfigError(f"{arch}.expert_gating_func={gating} is not supported (softmax only)")
    scale = meta("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise ModelConfigError(f"{arch}.expert_weights_scale={scale} is not supported")
    norm = meta("expert_weights_norm")
    norm = MOE_NORM_TOPK_DEFAULT[arch] if norm is None else bool(norm)
    used = int(need("expert_used_count"))
    if arch == "llama":  # Mixtral: the experts' width is feed_forward_length; always renormalised
        if not norm:
            raise ModelConfigError("llama.expert_weights_norm=false is not supported (Mixtral "
                                   "renormalises its top-k router weights)")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    out = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": norm,
           "moe_intermediate_size": int(need("expert_feed_forward_length"))}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(  # llama.cpp's default: feed_forward_length
            meta("expert_shared_feed_forward_length") or need("feed_forward_length")
            if shared else 0)
    return out


def _phi3_longrope(reader: gguf.GGUFReader, meta, need) -> dict[str, Any] | None:
    """HF's longrope rope_scaling from llama.cpp's factor tensors and metadata (None: plain)."""
    factors = {t.name: t for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if not factors:
        return None
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name not in factors:
            raise ModelConfigError(f"GGUF has LongRoPE factors but no {name} tensor")
    out: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": dequantize(factors["rope_factors_long.weight"]).reshape(-1).tolist(),
        "short_factor": dequantize(factors["rope_factors_short.weight"]).reshape(-1).tolist(),
        "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
    }
    attn = meta("rope.scaling.attn_factor")
    if attn is not None:  # llama.cpp's converter stores HF's own sqrt(1 + ln s / ln L) here
        out["attention_factor"] = float(attn)
    return out


def metadata_config(reader: gguf.GGUFReader) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_from_metadata(reader))


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary row pairs (rows are output features)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise WeightError(
            f"tensor {tensor.name!r} uses quantization type {qtype}, not supported; "
            f"supported: {SUPPORTED_QUANT_TYPES}")
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy wants them slowest-first (torch's [out, in]).
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_gguf(path: str | Path, dtype=jnp.float32, packed: bool = False
              ) -> tuple[ModelConfig, dict]:
    """Config and params of a GGUF file. ``packed``: keep quantized tensors packed
    (`models.packed`; dequantized inside the step by `models.qlinear`) instead of expanding
    them to ``dtype``: the dense projections, the embedding and the LM head."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(str(path))
    config = metadata_config(reader)
    arch = field_value(reader, "general.architecture")
    permuted = arch == "llama"  # Mistral and Mixtral too
    by_hf = {}
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name, arch)
        if hf is not None:
            by_hf[hf] = t

    @functools.lru_cache(maxsize=2)  # a stacked expert tensor serves its experts in a row
    def stacked(name: str) -> np.ndarray:
        arr = dequantize(by_hf[name])
        if arr.ndim != 3 or arr.shape[0] != config.num_experts:
            raise WeightError(f"tensor {by_hf[name].name!r} has shape {arr.shape}, expected "
                              f"{config.num_experts} stacked experts")
        return arr

    def get(name: str) -> np.ndarray | None:
        prefix, _, rest = name.partition(".mlp.experts.")
        parts = rest.split(".")
        if len(parts) == 3 and parts[0].isdigit():  # mlp.experts.{e}.{proj}.weight
            key = f"{prefix}.mlp.experts.{{e}}.{parts[1]}.weight"
            return stacked(key)[int(parts[0])] if key in by_hf else None
        t = by_hf.get(name)
        if t is None:
            return None
        arr = dequantize(t)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            arr = unpermute_rotary_rows(arr, config.num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            arr = unpermute_rotary_rows(arr, config.num_kv_heads)
        elif name.endswith("mlp.shared_expert_gate.weight") and arr.ndim == 1:
            arr = arr[None, :]  # llama.cpp's converter squeezes HF's [1, hidden]
        return arr

    def get_packed(name: str):
        t = by_hf.get(name)
        if t is None or t.tensor_type.name not in PACKED_TYPES or len(t.shape) != 2:
            return None
        k, n = (int(d) for d in t.shape)  # GGUF lists dims fastest-first: in, then out
        pw = pack_gguf(np.asarray(t.data), t.tensor_type.name, (k, n))
        heads = (config.num_heads if name.endswith("self_attn.q_proj.weight") else
                 config.num_kv_heads if name.endswith("self_attn.k_proj.weight") else None)
        if permuted and heads is not None:  # the rows of HF's [out, in] are our columns
            order = unpermute_rotary_rows(np.arange(n)[:, None], heads)[:, 0]
            pw = pw.columns(order)
        return pw

    return config, assemble_params(config, get, dtype,
                                   norms_offset_applied=arch.startswith("gemma"),
                                   get_packed=get_packed if packed else None)
