"""Sharded safetensors loading: each device's slice read via `get_slice`, equal to sharding
the fully loaded params (including KV-head replication)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from pathlib import Path
import jax, numpy as np
from models.config import ModelConfig
from models.hf_loader import load_hf_dir, load_sharded
from pagedjax.parallel.mesh import make_mesh, shard_params
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors, write_hf_dir

hf = {**TINY_HF_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 2}
cfg = ModelConfig.from_hf(hf)
tensors = random_hf_tensors(cfg, seed=1)
path = write_hf_dir(Path(sys.argv[1]), hf, tensors, shards=2)
out = {}
for tp in (2, 4):
    _, full = load_hf_dir(path)
    want = shard_params(full, cfg, make_mesh(tp))
    _, got = load_hf_dir(path, tensor_parallel_size=tp)
    same = jax.tree.map(
        lambda a, b: a.sharding == b.sharding and bool((np.asarray(a) == np.asarray(b)).all()),
        got, want)
    out[f"tp{tp}_equal"] = all(jax.tree.leaves(same))
# Largest slice read per tensor, as a fraction of the tensor, for the sharded q_proj.
reads = {}
class Spy:
    def __init__(self, s, name): self.s, self.name = s, name
    def get_shape(self): return self.s.get_shape()
    def __getitem__(self, idx):
        arr = self.s[idx]
        reads[self.name] = max(reads.get(self.name, 0), arr.size / np.prod(self.s.get_shape()))
        return arr
from safetensors import safe_open
from models.hf_loader import safetensors_files
files = safetensors_files(path)
handles = {f: safe_open(f, framework="numpy") for f in set(files.values())}
load_sharded(cfg, lambda n: Spy(handles[files[n]].get_slice(n), n), np.float32, make_mesh(4))
out["q_read_fraction"] = reads["model.layers.0.self_attn.q_proj.weight"]
out["embed_read_fraction"] = reads["model.embed_tokens.weight"]
print(json.dumps(out))
"""


def test_sharded_hf_loading_matches_and_reads_only_slices(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "hf")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tp2_equal"] and out["tp4_equal"]
    assert out["q_read_fraction"] == 0.25  # one device's quarter of the rows per read
    assert out["embed_read_fraction"] == 0.25  # vocab-split embedding
