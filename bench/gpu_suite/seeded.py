"""Seeded random Llama weights: the same numbers on the CPU that writes goldens and on the GPU.

The demo GGUF (98 MB) cannot travel to a lent GPU (64 MiB working-tree limit), so GPU
correctness runs on weights both sides *generate* from a seed with numpy's ``default_rng``
(PCG64, whose uniform stream numpy has kept stable across releases). Each tensor gets its own
child stream ``default_rng([seed, index])``, so generation order and memory peaks do not
change the numbers. :func:`fingerprint` hashes a slice of every tensor; the goldens store it,
so a numpy that ever changed the stream is reported as "different weights", not as an engine
error.

Scale: matrices are uniform with std 0.02 (``normal * 0.02`` in distribution, uniform because
it is ~4x faster to draw: 1.5 G numbers for the Llama-3-8B two-layer model), RMS-norm scales
are 1. Residual-stream activations then stay O(1) over 30 layers and logits have std ~0.5.

Full-size models used only for timing (Llama-3-8B, 13B-like) are drawn on the device with
``jax.random`` instead (:func:`device_random_params`): no golden depends on them and drawing
8-13 G numbers with numpy would cost minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from models.config import ModelConfig

WEIGHT_STD = 0.02
_UNIFORM_HALF_WIDTH = WEIGHT_STD * 3**0.5  # uniform(-a, a) has std a / sqrt(3)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    seed: int
    about: str


def _llama3_rope() -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.items()))


def _llama3_8b(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_llama3_rope(),
                       max_position_embeddings=8192)


SPECS: dict[str, ModelSpec] = {
    # --dry-run model: every code path of the suite in seconds on a CPU.
    "tiny": ModelSpec("tiny", ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024), 11,
        "dry-run toy: 2 layers, hidden 64, GQA 4/2, head_dim 16"),
    # SmolLM2-135M's shapes (the demo model): tied embeddings, GQA 9/3, head_dim 64.
    "demo": ModelSpec("demo", ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True), 135,
        "SmolLM2-135M shapes: 30 layers, hidden 576, 9/3 heads, d 64, vocab 49152, tied"),
    # Llama-3-8B layer shapes, 2 layers: goldens must fit the 24 GB CPU that writes them.
    "llama3_8b_2l": ModelSpec("llama3_8b_2l", _llama3_8b(2), 8,
                              "Llama-3-8B layer shapes (4096, 32/8 heads, d 128, 14336, vocab "
                              "128256, rope 500000 + llama3 scaling), 2 layers"),
    # Timing only (device-drawn weights, no goldens).
    "llama3_8b": ModelSpec("llama3_8b", _llama3_8b(32), 80, "Llama-3-8B shapes, 32 layers"),
    "llama_13b": ModelSpec("llama_13b", ModelConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
        num_kv_heads=40, head_dim=128, max_position_embeddings=4096), 13,
        "13B-like (Llama-2-13B shapes, MHA 40 heads; the paper's OPT-13B stand-in)"),
}


def tensor_shapes(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(dotted param path, shape) in a fixed order: the order defines each tensor's stream."""
    L, h, q, kv, i = (c.num_layers, c.hidden_size, c.num_heads * c.head_dim,
                      c.num_kv_heads * c.head_dim, c.intermediate_size)
    out = [("embed", (c.vocab_size, h)), ("final_norm", (h,)),
           ("layers.attn_norm", (L, h)), ("layers.mlp_norm", (L, h)),
           ("layers.q_proj.kernel", (L, h, q)), ("layers.k_proj.kernel", (L, h, kv)),
           ("layers.v_proj.kernel", (L, h, kv)), ("layers.o_proj.kernel", (L, q, h)),
           ("layers.gate_proj.kernel", (L, h, i)), ("layers.up_proj.kernel", (L, h, i)),
           ("layers.down_proj.kernel", (L, i, h))]
    if not c.tie_word_embeddings:
        out.append(("lm_head", (h, c.vocab_size)))
    return out


def _is_norm(path: str) -> bool:
    return path.endswith("norm")


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def seeded_numpy(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Flat {path: float32 array}, generated on the host from ``seed``."""
    out = {}
    for index, (path, shape) in enumerate(tensor_shapes(config)):
        if _is_norm(path):
            out[path] = np.ones(shape, np.float32)
            continue
        rng = np.random.default_rng([seed, index])
        x = rng.random(shape, dtype=np.float32)
        x -= np.float32(0.5)
        x *= np.float32(2 * _UNIFORM_HALF_WIDTH)
        out[path] = x
    return out


def seeded_params(config: ModelConfig, seed: int, dtype: Any = None) -> dict:
    """The engine's params pytree from :func:`seeded_numpy`, on the default device.

    ``dtype`` (e.g. ``jnp.bfloat16``) casts on the device, so a bf16 run holds bf16 weights.
    """
    import jax.numpy as jnp

    flat = seeded_numpy(config, seed)
    arrays = {}
    for path in list(flat):
        a = jnp.asarray(flat.pop(path))  # free the host copy as we go
        arrays[path] = a.astype(dtype) if dtype is not None else a
    return _nest(arrays)


def spec_params(name: str, dtype: Any = None) -> tuple[ModelConfig, dict]:
    spec = SPECS[name]
    return spec.config, seeded_params(spec.config, spec.seed, dtype)


def device_random_params(config: ModelConfig, seed: int, dtype: Any) -> dict:
    """Same distribution as :func:`seeded_params`, drawn on the device (timing-only models)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(seed)
    arrays = {}
    for index, (path, shape) in enumerate(tensor_shapes(config)):
        if _is_norm(path):
            arrays[path] = jnp.ones(shape, dtype)
            continue
        k = jax.random.fold_in(key, index)
        arrays[path] = jax.random.uniform(k, shape, dtype, -_UNIFORM_HALF_WIDTH, _UNIFORM_HALF_WIDTH)
    return _nest(arrays)


def fingerprint(config: ModelConfig, seed: int) -> str:
    """sha256 over the first 4096 values of every tensor's stream (cheap: no full draw)."""
    h = hashlib.sha256()
    for index, (path, shape) in enumerate(tensor_shapes(config)):
        h.update(f"{path}{shape}".encode())
        if not _is_norm(path):
            rng = np.random.default_rng([seed, index])
            h.update(rng.random(min(4096, int(np.prod(shape))), dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


def param_bytes(config: ModelConfig, itemsize: int) -> int:
    return sum(int(np.prod(s)) for _, s in tensor_shapes(config)) * itemsize


class NoTokenizer:
    """Token-id prompts only: the engine detokenizes for its text fields, so give it digits."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def __call__(self, text: str):
        raise ValueError("this model takes token-id prompts only")
