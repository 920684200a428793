"""Turn per-tensor weights (Hugging Face names, torch `[out, in]` layout) into our params pytree.

Every loader (safetensors, GGUF, ...) only has to answer "give me tensor NAME"; the checks of
names and shapes and the stacking of layers for `nn.scan` live here once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

# HF per-layer tensor name -> (our param key, transpose to [in, out]?)
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}


class WeightError(ValueError):
    """A tensor is missing, has the wrong shape, or uses an unsupported encoding."""


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shapes in HF layout for every tensor name the model needs."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (c.intermediate_size, h),
        "mlp.up_proj.weight": (c.intermediate_size, h),
        "mlp.down_proj.weight": (h, c.intermediate_size),
    }
    for i in range(c.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    return shapes


def assemble_params(config: LlamaConfig, get: Callable[[str], np.ndarray | None],
                    dtype=jnp.float32) -> dict:
    """Build the params pytree; `get(name)` returns the HF-layout array or None if absent."""
    shapes = expected_shapes(config)

    def fetch(name: str) -> np.ndarray:
        arr = get(name)
        if arr is None:
            raise WeightError(f"missing tensor {name!r}")
        if tuple(arr.shape) != shapes[name]:
            raise WeightError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shapes[name]}")
        return np.asarray(arr, dtype=np.float32)

    layers: dict[str, list[np.ndarray]] = {key: [] for key, _ in LAYER_TENSORS.values()}
    for i in range(config.num_layers):
        for name, (key, transpose) in LAYER_TENSORS.items():
            arr = fetch(f"model.layers.{i}.{name}")
            layers[key].append(arr.T if transpose else arr)

    def stacked(key: str) -> jnp.ndarray:
        return jnp.asarray(np.stack(layers.pop(key)), dtype=dtype)

    layer_params = {
        "attn_norm": stacked("attn_norm"),
        "mlp_norm": stacked("mlp_norm"),
    }
    for key in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        layer_params[key] = {"kernel": stacked(key)}
    params = {
        "embed": jnp.asarray(fetch("model.embed_tokens.weight"), dtype=dtype),
        "layers": layer_params,
        "final_norm": jnp.asarray(fetch("model.norm.weight"), dtype=dtype),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(fetch("lm_head.weight").T, dtype=dtype)
    return params


def abstract_params(config: LlamaConfig, dtype=jnp.float32) -> dict:
    """``jax.ShapeDtypeStruct`` tree of what `assemble_params` builds, without any memory
    (deviceless AOT compiles the step at 8B shapes from these)."""
    import jax

    shapes = expected_shapes(config)
    spec = lambda shape: jax.ShapeDtypeStruct(tuple(shape), dtype)
    layers: dict = {}
    for name, (key, transpose) in LAYER_TENSORS.items():
        shape = shapes[f"model.layers.0.{name}"]
        stacked = spec((config.num_layers, *(shape[::-1] if transpose else shape)))
        layers[key] = stacked if key.endswith("norm") else {"kernel": stacked}
    params = {
        "embed": spec(shapes["model.embed_tokens.weight"]),
        "layers": layers,
        "final_norm": spec(shapes["model.norm.weight"]),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = spec(shapes["lm_head.weight"][::-1])
    return params


def params_to_hf(config: LlamaConfig, params: dict) -> dict[str, np.ndarray]:
    """Inverse of `assemble_params` (used to write HF checkpoints in tests and tools)."""
    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"], np.float32).T
    lp = params["layers"]
    for name, (key, transpose) in LAYER_TENSORS.items():
        stacked = lp[key]["kernel"] if transpose else lp[key]
        stacked = np.asarray(stacked, np.float32)
        for i in range(config.num_layers):
            out[f"model.layers.{i}.{name}"] = np.ascontiguousarray(
                stacked[i].T if transpose else stacked[i])
    return out
