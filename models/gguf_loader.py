"""Load a llama.cpp GGUF file: config from metadata, tensors dequantized to floats.

llama.cpp's converter permutes the rows of Q and K so that its rotary kernel can rotate
adjacent pairs; our model (like HF) rotates halves, so those rows are permuted back here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, ModelConfigError
from models.weights import WeightError, assemble_params

# Quantization types we dequantize; anything else is refused by name.
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

GGUF_TO_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_TO_HF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_name_to_hf(name: str) -> str | None:
    if name in GGUF_TO_HF_GLOBAL:
        return GGUF_TO_HF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_TO_HF_LAYER:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF_LAYER[parts[2]]}"
    return None


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def metadata_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ModelConfigError(
            f"unsupported architecture {arch!r} in GGUF general.architecture; supported: ('llama',)")

    def need(key: str) -> Any:
        value = field_value(reader, f"llama.{key}")
        if value is None:
            raise ModelConfigError(f"GGUF metadata is missing llama.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = field_value(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelConfigError("GGUF metadata has neither llama.vocab_size nor tokenizer tokens")
        vocab = len(tokens.data)
    names = {t.name for t in reader.tensors}
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if field_value(reader, "llama.rope.scaling.type") == "llama3" or "rope_freqs.weight" in names:
        factor = field_value(reader, "llama.rope.scaling.factor")
        if factor is None:
            raise ModelConfigError("llama3 rope scaling without llama.rope.scaling.factor")
        scaling = tuple(sorted({
            "rope_type": "llama3", "factor": float(factor),
            "low_freq_factor": float(field_value(reader, "llama.rope.scaling.low_freq_factor") or 1.0),
            "high_freq_factor": float(field_value(reader, "llama.rope.scaling.high_freq_factor") or 4.0),
            "original_max_position_embeddings": int(
                field_value(reader, "llama.rope.scaling.original_context_length") or 8192),
        }.items()))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field_value(reader, "llama.attention.head_count_kv") or num_heads),
        head_dim=int(field_value(reader, "llama.rope.dimension_count") or hidden // num_heads),
        rms_norm_eps=float(field_value(reader, "llama.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(field_value(reader, "llama.rope.freq_base") or 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(field_value(reader, "llama.context_length") or 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


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


def load_gguf(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(str(path))
    config = metadata_config(reader)
    by_hf = {}
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name)
        if hf is not None:
            by_hf[hf] = t

    def get(name: str) -> np.ndarray | None:
        t = by_hf.get(name)
        if t is None:
            return None
        arr = dequantize(t)
        if name.endswith("self_attn.q_proj.weight"):
            arr = unpermute_rotary_rows(arr, config.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            arr = unpermute_rotary_rows(arr, config.num_kv_heads)
        return arr

    return config, assemble_params(config, get, dtype)
