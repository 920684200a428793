"""Load a Hugging Face directory: `config.json` (+ `generation_config.json`) and
`model.safetensors` or a sharded index, for every family `ModelConfig` reads."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from models.config import ModelConfig
from models.weights import WeightError, assemble_params, expected_shapes, layer_tensors


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


def load_hf_dir(path: str | Path, dtype=jnp.float32, tensor_parallel_size: int = 1,
                shard_vocab: bool = True) -> tuple[ModelConfig, dict]:
    """Load config and params; with `tensor_parallel_size` > 1 the params come back already
    placed on the ("tp",) mesh and each process reads only its devices' slices."""
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    files = safetensors_files(path)
    handles: dict[Path, object] = {}

    def handle(name: str):
        fname = files.get(name)
        if fname is None:
            return None
        if fname not in handles:
            if not fname.is_file():
                raise WeightError(f"index names {fname.name} for {name!r} but the file is missing")
            handles[fname] = safe_open(fname, framework="numpy")
        return handles[fname]

    if tensor_parallel_size > 1 and sliceable(config):
        from pagedjax.parallel.mesh import make_mesh, validate_tp

        validate_tp(config, tensor_parallel_size)  # before reading any weight
        mesh = make_mesh(tensor_parallel_size)
        return config, load_sharded(config, lambda n: (h := handle(n)) and h.get_slice(n),
                                    dtype, mesh, shard_vocab)

    def get(name: str) -> np.ndarray | None:
        h = handle(name)
        return None if h is None else _to_numpy(h, name)

    return config, assemble_params(config, get, dtype)


def sliceable(config: ModelConfig) -> bool:
    """Whether `load_sharded` can read this family slice by slice: Llama's tensor set (no
    biases, q/k norms, sandwich norms or experts). Other families load whole and the runner
    places them on the mesh (`shard_params`)."""
    return not (config.qkv_bias or config.o_bias or config.qk_norm or config.sandwich_norm
                or config.num_experts)


def load_sharded(config: ModelConfig, get_slice, dtype, mesh, shard_vocab: bool = True) -> dict:
    """Build each param with `jax.make_array_from_callback`: the callback of a device reads
    only that device's slice through safetensors' lazy `get_slice` (HF `[out, in]` layout,
    so a column-parallel shard is a row range of the file's tensor). KV-head replication
    (N > num_kv_heads) maps each replicated head back to the original rows it copies."""
    import jax

    from pagedjax.parallel.mesh import AXIS, kv_replication, param_shardings

    shapes = expected_shapes(config)
    n = mesh.shape[AXIS]
    r = kv_replication(config, n)
    d = config.head_dim
    np_dtype = np.dtype(dtype)
    shardings = param_shardings(mesh, config, shard_vocab)

    def sl(name: str):
        s = get_slice(name)
        if s is None:
            raise WeightError(f"missing tensor {name!r}")
        if tuple(s.get_shape()) != shapes[name]:
            raise WeightError(
                f"tensor {name!r} has shape {tuple(s.get_shape())}, expected {shapes[name]}")
        return s

    def read(name: str, index: tuple[slice, ...], transpose: bool, replicate: int = 1) -> np.ndarray:
        """Our-layout `index` of tensor `name` (transposed HF layout when `transpose`)."""
        s = sl(name)
        if not transpose:
            return np.asarray(s[index], np.float32)
        rows, cols = index[1], index[0]  # ours [in, out] = HF [out, in].T
        if replicate == 1:
            return np.asarray(s[rows, cols], np.float32).T
        total = shapes[name][0] * replicate
        want = np.arange(total)[rows]  # replicated output columns of this shard
        orig = (want // d // replicate) * d + want % d
        lo, hi = int(orig.min()), int(orig.max()) + 1
        return np.asarray(s[lo:hi, cols], np.float32)[orig - lo].T

    def make(shape, sharding, cb):
        return jax.make_array_from_callback(shape, sharding, lambda idx: cb(idx).astype(np_dtype))

    layer_params: dict = {}
    for t in layer_tensors(config):
        suffix, key, transpose = t.hf, t.key[0], t.transpose
        shape0 = shapes[f"model.layers.0.{suffix}"]
        rep = r if key in ("k_proj", "v_proj") else 1
        ours = (shape0[1], shape0[0] * rep) if transpose else shape0
        sharding = shardings["layers"][key]["kernel"] if transpose else shardings["layers"][key]

        def cb(idx, suffix=suffix, transpose=transpose, rep=rep):
            layers = range(*idx[0].indices(config.num_layers))
            return np.stack([read(f"model.layers.{i}.{suffix}", idx[1:], transpose, rep)
                             for i in layers])

        arr = make((config.num_layers, *ours), sharding, cb)
        layer_params[key] = {"kernel": arr} if transpose else arr
    params = {
        "embed": make(shapes["model.embed_tokens.weight"], shardings["embed"],
                      lambda idx: read("model.embed_tokens.weight", idx, False)),
        "layers": layer_params,
        "final_norm": make(shapes["model.norm.weight"], shardings["final_norm"],
                           lambda idx: read("model.norm.weight", idx, False)),
    }
    if not config.tie_word_embeddings:
        v, h = shapes["lm_head.weight"]
        params["lm_head"] = make((h, v), shardings["lm_head"],
                                 lambda idx: read("lm_head.weight", idx, True))
    return params
