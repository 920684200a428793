"""Small random checkpoints written in HF and GGUF formats, for loader tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from models.config import ModelConfig  # noqa: I001

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def random_hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    from models.weights import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_hf_dir(path: Path, hf_config: dict, tensors: dict[str, np.ndarray],
                 shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the loader must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    # MoE: the router and Qwen2-MoE's shared expert (routed experts are stacked, below)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# Gemma's sandwich norms, as llama.cpp names them.
HF_TO_GGUF_GEMMA = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's fused tensors: HF's qkv_proj (q, k, v rows) and gate_up_proj (gate rows first).
PHI3_FUSED = {"self_attn.q_proj.weight": ("attn_qkv.weight", 0),
              "self_attn.k_proj.weight": ("attn_qkv.weight", 1),
              "self_attn.v_proj.weight": ("attn_qkv.weight", 2),
              "mlp.gate_proj.weight": ("ffn_up.weight", 0), "mlp.up_proj.weight": ("ffn_up.weight", 1)}


def _gguf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray],
                  arch: str) -> dict[str, np.ndarray]:
    """Canonical HF tensors -> llama.cpp's tensor names and layouts (numpy [out, in] order)."""
    names = {**HF_TO_GGUF, **HF_TO_GGUF_GEMMA} if arch.startswith("gemma") else HF_TO_GGUF
    out: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}  # fused / stacked tensor -> its pieces
    for hf_name, arr in tensors.items():
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[hf_name]
            out[name] = arr + np.float32(1.0) if arch.startswith("gemma") and "norm" in name else arr
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest.startswith("mlp.experts."):  # mlp.experts.{e}.{proj}.weight -> ffn_*_exps
            _, _, e, proj, _ = rest.split(".")
            stacked = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
            parts.setdefault(stacked, {})[int(e)] = arr
            continue
        if arch == "phi3" and rest in PHI3_FUSED:
            fused, index = PHI3_FUSED[rest]
            parts.setdefault(f"blk.{layer}.{fused}", {})[index] = arr
            continue
        if rest == "self_attn.q_proj.weight" and arch == "llama":
            arr = _permute_rotary(arr, config.num_heads)
        elif rest == "self_attn.k_proj.weight" and arch == "llama":
            arr = _permute_rotary(arr, config.num_kv_heads)
        elif rest == "mlp.shared_expert_gate.weight":
            arr = arr.squeeze()  # the converter squeezes [1, hidden] to [hidden]
        if arch.startswith("gemma") and "norm" in rest:
            arr = arr + np.float32(1.0)
        out[f"blk.{layer}.{names[rest]}"] = arr
    for name, pieces in parts.items():
        ordered = [pieces[i] for i in range(len(pieces))]
        out[name] = np.stack(ordered) if name.endswith("_exps.weight") else np.concatenate(ordered)
    scaling = dict(config.rope_scaling or ())
    if arch == "llama" and scaling.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_freqs(config.rotary_dim, config.rope_theta, scaling)
    if arch == "phi3" and scaling.get("rope_type") in ("longrope", "su"):
        out["rope_factors_long.weight"] = np.asarray(scaling["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(scaling["short_factor"], np.float32)
    return out


def _llama3_rope_freqs(dim: int, theta: float, s: dict) -> np.ndarray:
    """llama.cpp's converter: Llama 3's scaling as per-dimension divisors of the frequencies
    (the rope_freqs.weight tensor; no scaling keys are written)."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, np.ndarray],
               quant: str = "F32", arch: str = "llama", skip: str | None = None,
               extra_kv: dict | None = None, skip_kv: tuple[str, ...] = ()) -> Path:
    """As llama.cpp's converter writes it: Llama's Q/K rows permuted (Mistral's and Mixtral's
    too: they are ``llama`` files), Gemma's norms + 1, Phi-3's fused ``attn_qkv`` / ``ffn_up``
    and LongRoPE factor tensors, Llama 3's rope_freqs tensor, YaRN's keys, MoE experts stacked
    per layer with their counts in metadata.
    `skip` leaves out a tensor, `skip_kv` metadata keys; `extra_kv` is written last."""
    w = gguf.GGUFWriter(str(path), arch)
    K, T = gguf.Keys, gguf.GGUFValueType

    def put(template: str, value, vtype) -> None:
        key = template.format(arch=arch)
        if key not in skip_kv:
            w.add_key_value(key, value, vtype)

    if arch != "phi3":  # Phi-3's converter writes no key_length (head_dim = hidden / heads)
        put(K.Attention.KEY_LENGTH, config.head_dim, T.UINT32)
    put(K.LLM.BLOCK_COUNT, config.num_layers, T.UINT32)
    put(K.LLM.CONTEXT_LENGTH, config.max_position_embeddings, T.UINT32)
    put(K.LLM.EMBEDDING_LENGTH, config.hidden_size, T.UINT32)
    put(K.LLM.FEED_FORWARD_LENGTH, config.intermediate_size, T.UINT32)
    put(K.Attention.HEAD_COUNT, config.num_heads, T.UINT32)
    put(K.Attention.HEAD_COUNT_KV, config.num_kv_heads, T.UINT32)
    put(K.Rope.FREQ_BASE, config.rope_theta, T.FLOAT32)
    put(K.Attention.LAYERNORM_RMS_EPS, config.rms_norm_eps, T.FLOAT32)
    put(K.LLM.VOCAB_SIZE, config.vocab_size, T.UINT32)
    put(K.Rope.DIMENSION_COUNT, config.rotary_dim, T.UINT32)
    scaling = dict(config.rope_scaling or ())
    if scaling.get("rope_type") == "linear":
        put(K.Rope.SCALING_TYPE, gguf.RopeScalingType.LINEAR.value, T.STRING)
        put(K.Rope.SCALING_FACTOR, scaling["factor"], T.FLOAT32)
    if scaling.get("rope_type") == "yarn":  # the converter renames HF's keys
        put(K.Rope.SCALING_TYPE, gguf.RopeScalingType.YARN.value, T.STRING)
        put(K.Rope.SCALING_FACTOR, scaling["factor"], T.FLOAT32)
        put(K.Rope.SCALING_ORIG_CTX_LEN, int(scaling["original_max_position_embeddings"]), T.UINT32)
        for hf_key, key in (("attention_factor", K.Rope.SCALING_YARN_ATTN_FACTOR),
                            ("beta_fast", K.Rope.SCALING_YARN_BETA_FAST),
                            ("beta_slow", K.Rope.SCALING_YARN_BETA_SLOW)):
            if scaling.get(hf_key) is not None:
                put(key, scaling[hf_key], T.FLOAT32)
    if arch == "phi3" and scaling.get("rope_type") in ("longrope", "su"):
        orig = int(scaling["original_max_position_embeddings"])
        scale = config.max_position_embeddings / orig
        put(K.Rope.SCALING_ORIG_CTX_LEN, orig, T.UINT32)
        put(K.Rope.SCALING_ATTN_FACTOR,
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0, T.FLOAT32)
    if arch == "phi3" or (arch == "llama" and config.layer_windows):
        put(K.Attention.SLIDING_WINDOW, max(config.windows), T.UINT32)  # Phi-3: 0 = none
    if config.num_experts:
        put(K.LLM.EXPERT_COUNT, config.num_experts, T.UINT32)
        put(K.LLM.EXPERT_USED_COUNT, config.num_experts_per_tok, T.UINT32)
        if arch != "llama":  # Mixtral's experts are feed_forward_length wide
            put(K.LLM.EXPERT_FEED_FORWARD_LENGTH, config.moe_intermediate_size, T.UINT32)
        if config.shared_expert_intermediate_size:
            put(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, config.shared_expert_intermediate_size,
                T.UINT32)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    qtype = gguf.GGMLQuantizationType[quant]
    for name, arr in _gguf_tensors(config, tensors, arch).items():
        if name == skip:
            continue
        if arr.ndim >= 2 and quant != "F32":
            wtype = qtype
            try:
                data = gguf.quants.quantize(arr, qtype)
            except gguf.QuantError:  # rows not a whole number of blocks: F16, as the converter
                wtype, data = gguf.GGMLQuantizationType.F16, arr.astype(np.float16)
            except NotImplementedError:  # a type gguf cannot write: right-sized zero blocks
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = np.zeros((*arr.shape[:-1], arr.shape[-1] // block * size), np.uint8)
            if wtype == qtype:
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            else:
                w.add_tensor(name, data)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
