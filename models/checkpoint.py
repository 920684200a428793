"""Converted checkpoints: params saved with orbax plus our config (the fast load path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from models.config import ModelConfig

CONFIG_FILE = "pagedjax_config.json"
PARAMS_DIR = "params"


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_checkpoint(path: str | Path, config: ModelConfig, params: dict,
                    tokenizer=None, dtype: str | None = None) -> Path:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    params_dir = path / PARAMS_DIR
    if params_dir.exists():
        shutil.rmtree(params_dir)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(params_dir, params)
        ckptr.wait_until_finished()
    meta = {"config": config.to_dict(), "dtype": dtype or str(jax.tree.leaves(params)[0].dtype)}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path / "tokenizer"))
    return path


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict]:
    path = Path(path).absolute()
    meta = json.loads((path / CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["config"])
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path / PARAMS_DIR)
    params = jax.tree.map(lambda x: jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x, params)
    return config, params
