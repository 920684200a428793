"""Load a Hugging Face Llama directory: `config.json` + `model.safetensors` (or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from models.config import LlamaConfig
from models.weights import WeightError, assemble_params


def safetensors_files(path: Path) -> dict[str, Path]:
    """Map tensor name -> file, from the sharded index or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightError(f"{index} has no 'weight_map'")
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


def _to_numpy(f, name: str) -> np.ndarray:
    return f.get_tensor(name)


def load_hf_dir(path: str | Path, dtype=jnp.float32) -> tuple[LlamaConfig, dict]:
    path = Path(path)
    config = LlamaConfig.from_hf_dir(path)
    files = safetensors_files(path)
    handles: dict[Path, object] = {}

    def get(name: str) -> np.ndarray | None:
        fname = files.get(name)
        if fname is None:
            return None
        if fname not in handles:
            if not fname.is_file():
                raise WeightError(f"index names {fname.name} for {name!r} but the file is missing")
            handles[fname] = safe_open(fname, framework="numpy")
        return _to_numpy(handles[fname], name)

    return config, assemble_params(config, get, dtype)
