"""Small random Llama checkpoints written in HF and GGUF formats, for loader tests."""

from __future__ import annotations

import json
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
}
# Gemma's sandwich norms, as llama.cpp names them.
HF_TO_GGUF_GEMMA = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, np.ndarray],
               quant: str = "F32", arch: str = "llama", skip: str | None = None,
               extra_kv: dict | None = None) -> Path:
    """As llama.cpp's converter writes it: Llama's Q/K rows permuted, Gemma's norms + 1."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    names = {**HF_TO_GGUF, **HF_TO_GGUF_GEMMA} if arch.startswith("gemma") else HF_TO_GGUF
    w.add_key_length(config.head_dim)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)
    qtype = gguf.GGMLQuantizationType[quant]
    for hf_name, arr in tensors.items():
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            name = f"blk.{layer}.{names[rest]}"
            if rest == "self_attn.q_proj.weight" and arch == "llama":
                arr = _permute_rotary(arr, config.num_heads)
            elif rest == "self_attn.k_proj.weight" and arch == "llama":
                arr = _permute_rotary(arr, config.num_kv_heads)
        if arch.startswith("gemma") and "norm" in hf_name:
            arr = arr + np.float32(1.0)
        if name == skip:
            continue
        if arr.ndim == 2 and quant != "F32":
            try:
                data = gguf.quants.quantize(arr, qtype)
            except NotImplementedError:  # a type gguf cannot write: right-sized zero blocks
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
