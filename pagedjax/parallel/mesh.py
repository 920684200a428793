"""Megatron-style tensor parallelism: the mesh, the sharding plan, and the KV-head rule.

One mesh axis, ``"tp"``. Every projection is split so that each device computes whole heads
(attention) or a contiguous slice of the MLP's intermediate features, and the only
communication per layer is the two all-reduces XLA inserts after the row-parallel
``o_proj`` and ``down_proj`` (paper §4.6). Nothing here is specific to one process: the same
plan builds the mesh over ``jax.devices()`` after ``jax.distributed.initialize()``.

KV-head rule (checked by `validate_tp` before any weight is loaded):

* N must divide ``num_heads`` (each device owns ``num_heads / N`` query heads), and
  ``intermediate_size`` (the MLP split);
* either N divides ``num_kv_heads`` (each device owns ``num_kv_heads / N`` KV heads), or
  ``num_kv_heads`` divides N, and then every KV head is replicated ``N / num_kv_heads`` times:
  the k/v projection columns are repeated so that each device owns one copy, and the cache
  holds N KV heads (one per device). Query head ``i`` still reads original KV head
  ``i // (num_heads / num_kv_heads)``, because ``floor(floor(i/a)/b) == floor(i/(a*b))``.
* N must not exceed the number of devices in the (global) mesh.

Embedding / LM head: split on the vocabulary (``embed[V/N, H]``, ``lm_head[H, V/N]``) when N
divides the vocabulary, else replicated. The split costs one all-reduce for the token lookup
and one all-gather of the sampled rows' logits per step, and saves ``(N-1)/N`` of the largest
single tensors of small models (28% of SmolLM2-135M's parameters); `bench/tensor_parallel.py`
measures both (``docs/tensor-parallel.md`` records the numbers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig

AXIS = "tp"


class TensorParallelError(ValueError):
    """The tensor-parallel size does not fit the model or the available devices."""


def validate_tp(config: ModelConfig, n: int, num_devices: int | None = None,
                expert_parallel: bool = False) -> None:
    """Raise `TensorParallelError` naming the offending quantity; cheap, call before loading."""
    if not isinstance(n, int) or n < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer; got {n!r}")
    if n == 1:
        return
    devices = jax.device_count() if num_devices is None else num_devices
    if n > devices:
        raise TensorParallelError(
            f"tensor_parallel_size={n} exceeds the {devices} available device(s) "
            f"({jax.default_backend()})")
    if config.num_heads % n:
        raise TensorParallelError(
            f"tensor_parallel_size={n} must divide the number of attention heads "
            f"({config.num_heads})")
    kv = config.num_kv_heads
    if kv % n and n % kv:
        raise TensorParallelError(
            f"tensor_parallel_size={n} must divide the number of KV heads ({kv}) or be a "
            f"multiple of it (KV heads are then replicated)")
    widths = {"moe_intermediate_size": config.moe_intermediate_size,
              "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    if expert_parallel and config.num_experts:
        if config.num_experts % n:
            raise TensorParallelError(
                f"enable_expert_parallel: tensor_parallel_size={n} must divide the number of "
                f"experts ({config.num_experts})")
        del widths["moe_intermediate_size"]  # experts stay whole
    if not config.num_experts:
        widths = {"intermediate_size": config.intermediate_size}
    for name, width in widths.items():
        if width % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide {name} ({width})")


def kv_replication(config: ModelConfig, n: int) -> int:
    """How many copies of each KV head the sharded model holds (1 unless N > num_kv_heads)."""
    return n // config.num_kv_heads if n > config.num_kv_heads else 1


def sharded_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config the sharded model runs with: KV heads counted after replication."""
    r = kv_replication(config, n)
    return config if r == 1 else dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)


def make_mesh(n: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first N devices (global devices in multi-process runs)."""
    devs = list(devices if devices is not None else jax.devices())[:n]
    if len(devs) < n:
        raise TensorParallelError(f"need {n} devices for the mesh, have {len(devs)}")
    return Mesh(np.asarray(devs), (AXIS,))


def vocab_sharded(config: ModelConfig, n: int, shard_vocab: bool = True) -> bool:
    return shard_vocab and n > 1 and config.vocab_size % n == 0


# Layer params by how tensor parallelism splits them (Megatron-style: column-parallel into
# the heads / MLP width, row-parallel back out, one all-reduce each for attention and MLP).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "shared_gate_proj",
           "shared_up_proj")
_ROW = ("o_proj", "down_proj", "shared_down_proj")


# A packed weight's leaves (`models.qlinear`): [L, K or K/2, N] codes and [L, K/group, N]
# scales and offsets, split like a kernel.
_WEIGHT_LEAVES = ("kernel", "codes", "scale", "offset")


def _layer_spec(key: str, leaf: str, expert_parallel: bool = False) -> P:
    """Spec of one stacked layer param ``[L, ...]``. Experts are split along their width
    (every device holds a slice of every expert), so routing needs no communication, or with
    ``expert_parallel`` by expert (`parallel.experts`); norms, the router and the row-parallel
    biases (added after the all-reduce) are replicated."""
    if expert_parallel and key in ("expert_gate", "expert_up", "expert_down"):
        return P(None, AXIS, None, None)  # [L, E, ., .]
    if key in _COLUMN:
        return P(None, None, AXIS) if leaf in _WEIGHT_LEAVES else P(None, AXIS)
    if key in _ROW:
        return P(None, AXIS, None) if leaf in _WEIGHT_LEAVES else P()
    if key in ("expert_gate", "expert_up"):  # [L, E, H, I]
        return P(None, None, None, AXIS)
    if key == "expert_down":  # [L, E, I, H]
        return P(None, None, AXIS, None)
    return P()


def _splits(shape: tuple[int, ...], spec: P, n: int, group: int = 1) -> bool:
    """Whether every sharded axis of ``shape`` splits into n equal parts of whole groups."""
    return all(ax is None or shape[i] % (n * group) == 0 for i, ax in enumerate(spec))


def _packed_specs(sub: dict, spec_of, n: int) -> dict:
    """A packed weight's leaf specs, or all replicated when its blocks would not split whole
    across n devices (4-bit codes pair elements 16 apart within 32-element groups, so a
    row-parallel split must cut K at multiples of 32); XLA then moves activations instead."""
    specs = {leaf: spec_of(leaf) for leaf in sub}
    # Codes split in multiples of 16 rows: 32 elements of 4-bit codes, or 16 of 8-bit ones
    # (scales splitting evenly puts the cut on a group boundary either way).
    ok = all(_splits(tuple(a.shape), specs[leaf], n, 16 if leaf == "codes" else 1)
             for leaf, a in sub.items())
    return specs if ok else {leaf: P() for leaf in sub}


def param_specs(config: ModelConfig, n: int, shard_vocab: bool = True,
                expert_parallel: bool = False, params: dict | None = None) -> dict:
    """PartitionSpecs matching the params pytree of `models.decoder.DecoderLM` (``params``:
    the actual tree, which may hold packed weights; else the float layout)."""
    from models.qlinear import is_packed
    from models.weights import abstract_params

    tree = params if params is not None else abstract_params(config)
    vocab = vocab_sharded(config, n, shard_vocab)
    layers = {}
    for key, sub in tree["layers"].items():
        spec_of = lambda leaf, key=key: _layer_spec(key, leaf, expert_parallel)  # noqa: E731
        if is_packed(sub):
            layers[key] = _packed_specs(sub, spec_of, n)
        elif isinstance(sub, dict):
            layers[key] = {leaf: spec_of(leaf) for leaf in sub}
        else:
            layers[key] = spec_of("")
    specs = {"layers": layers, "final_norm": P()}
    # The vocab axis: first of a float embedding [V, H], last of a packed one [H, V] (and
    # of the LM head [H, V] either way).
    for name in ("embed", "lm_head"):
        if name not in tree:
            continue
        sub = tree[name]
        if is_packed(sub):
            specs[name] = _packed_specs(sub, lambda _: P(None, AXIS) if vocab else P(), n)
        elif name == "embed":
            specs[name] = P(AXIS, None) if vocab else P()
        else:
            specs[name] = P(None, AXIS) if vocab else P()
    return specs


def param_shardings(mesh: Mesh, config: ModelConfig, shard_vocab: bool = True,
                    expert_parallel: bool = False, params: dict | None = None) -> dict:
    n = mesh.shape[AXIS]
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        param_specs(config, n, shard_vocab, expert_parallel, params),
                        is_leaf=lambda x: isinstance(x, P))


CACHE_SPEC = P(None, AXIS, None, None, None)  # [L, Hkv, blocks, block_size, D]: by KV head


def cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, CACHE_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicate_kv_columns(kernel: np.ndarray | jax.Array, head_dim: int, r: int):
    """[..., in, Hkv*D] -> [..., in, Hkv*r*D]: each head's columns repeated r times, in place
    order (head j becomes heads j*r .. j*r+r-1), so device d owns a copy of head d // r."""
    if r == 1:
        return kernel
    xp = jnp if isinstance(kernel, jax.Array) else np
    *lead, cols = kernel.shape
    heads = cols // head_dim
    k = kernel.reshape(*lead, heads, head_dim)
    k = xp.repeat(k, r, axis=-2)
    return k.reshape(*lead, heads * r * head_dim)


def shard_params(params: dict, config: ModelConfig, mesh: Mesh, shard_vocab: bool = True,
                 expert_parallel: bool = False) -> dict:
    """Place a params pytree on the mesh (replicating KV columns when N > num_kv_heads).

    Arrays that already carry the target sharding (e.g. from the sharded safetensors loader)
    are left alone; host or single-device arrays are split by `device_put`, which copies each
    device only its slice.
    """
    n = mesh.shape[AXIS]
    r = kv_replication(config, n)
    layers = dict(params["layers"])
    want_cols = config.num_kv_heads * r * config.head_dim
    for key in ("k_proj", "v_proj"):  # kernels, biases and packed leaves: columns last
        cols = jax.tree.leaves(layers[key])[0].shape[-1]
        if cols != want_cols:
            layers[key] = {leaf: replicate_kv_columns(a, config.head_dim, r)
                           for leaf, a in layers[key].items()}
    params = {**params, "layers": layers}
    shardings = param_shardings(mesh, config, shard_vocab, expert_parallel, params)
    return jax.tree.map(_place, params, shardings)


def abstract_sharded_params(params: dict, config: ModelConfig, mesh: Mesh,
                            shard_vocab: bool = True, expert_parallel: bool = False) -> dict:
    """`shard_params` on a ShapeDtypeStruct tree: KV columns replicated, shardings attached."""
    r = kv_replication(config, mesh.shape[AXIS])
    layers = dict(params["layers"])
    for key in ("k_proj", "v_proj"):
        layers[key] = {leaf: jax.ShapeDtypeStruct((*a.shape[:-1], a.shape[-1] * r), a.dtype)
                       for leaf, a in layers[key].items()}
    params = {**params, "layers": layers}
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        params, param_shardings(mesh, config, shard_vocab, expert_parallel,
                                                params))


def _place(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def sharded_param_bytes(params: dict) -> tuple[int, int]:
    """(total bytes, largest per-device bytes) of a placed params pytree, from the shardings."""
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(params):
        total += leaf.size * leaf.dtype.itemsize
        for dev, idx in leaf.sharding.devices_indices_map(leaf.shape).items():
            shape = [len(range(*s.indices(d))) for s, d in zip(idx, leaf.shape)]
            per_device[dev] = per_device.get(dev, 0) + math.prod(shape) * leaf.dtype.itemsize
    return total, max(per_device.values())
