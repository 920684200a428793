"""Turn per-tensor weights (Hugging Face names, torch `[out, in]` layout) into our params pytree.

Every loader (safetensors, GGUF, ...) only has to answer "give me tensor NAME" in HF's
canonical per-tensor naming; the family's tensor list, the checks of names and shapes and the
stacking of layers for `nn.scan` live here once. `canonical_getter` maps the other layouts
checkpoints use onto those names: Phi-3's fused ``qkv_proj`` / ``gate_up_proj``, Mixtral's
``block_sparse_moe.experts.E.w1/w2/w3`` and transformers v5's fused expert tensors.

Gemma's RMSNorm multiplies by ``1 + w``; its norm weights are stored here with the 1 added,
so the model has one norm for every family (GGUF files already carry ``1 + w``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

Getter = Callable[[str], "np.ndarray | None"]


class WeightError(ValueError):
    """A tensor is missing, has the wrong shape, or uses an unsupported encoding."""


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One per-layer tensor: HF name suffix (``{e}`` stands for the expert index), where it
    goes in the layer's params, its HF-layout shape, and how it is transformed."""

    hf: str
    key: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False  # torch [out, in] -> our [in, out]
    norm: bool = False
    experts: bool = False  # one HF tensor per expert, stacked on a leading expert axis


def gemma_norms(config: ModelConfig) -> bool:
    return config.architecture.startswith("gemma")


def layer_tensors(config: ModelConfig) -> list[LayerTensor]:
    """The tensors of one decoder layer for this config's family."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = [LayerTensor("input_layernorm.weight", ("attn_norm",), (h,), norm=True)]
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append(LayerTensor(f"self_attn.{name}.weight", (name, "kernel"), (rows, h), True))
        if c.qkv_bias:
            out.append(LayerTensor(f"self_attn.{name}.bias", (name, "bias"), (rows,)))
    out.append(LayerTensor("self_attn.o_proj.weight", ("o_proj", "kernel"), (h, q), True))
    if c.o_bias:
        out.append(LayerTensor("self_attn.o_proj.bias", ("o_proj", "bias"), (h,)))
    if c.qk_norm:
        out += [LayerTensor("self_attn.q_norm.weight", ("q_norm",), (c.head_dim,), norm=True),
                LayerTensor("self_attn.k_norm.weight", ("k_norm",), (c.head_dim,), norm=True)]
    if c.sandwich_norm:
        out += [LayerTensor("post_attention_layernorm.weight", ("post_attn_norm",), (h,), norm=True),
                LayerTensor("pre_feedforward_layernorm.weight", ("mlp_norm",), (h,), norm=True),
                LayerTensor("post_feedforward_layernorm.weight", ("post_mlp_norm",), (h,),
                            norm=True)]
    else:
        out.append(LayerTensor("post_attention_layernorm.weight", ("mlp_norm",), (h,), norm=True))
    if c.num_experts:
        e, i = c.num_experts, c.moe_intermediate_size
        out += [LayerTensor("mlp.gate.weight", ("router",), (e, h), True),
                LayerTensor("mlp.experts.{e}.gate_proj.weight", ("expert_gate",), (i, h), True,
                            experts=True),
                LayerTensor("mlp.experts.{e}.up_proj.weight", ("expert_up",), (i, h), True,
                            experts=True),
                LayerTensor("mlp.experts.{e}.down_proj.weight", ("expert_down",), (h, i), True,
                            experts=True)]
        si = c.shared_expert_intermediate_size
        if si:
            out += [LayerTensor("mlp.shared_expert.gate_proj.weight", ("shared_gate_proj", "kernel"),
                                (si, h), True),
                    LayerTensor("mlp.shared_expert.up_proj.weight", ("shared_up_proj", "kernel"),
                                (si, h), True),
                    LayerTensor("mlp.shared_expert.down_proj.weight",
                                ("shared_down_proj", "kernel"), (h, si), True),
                    LayerTensor("mlp.shared_expert_gate.weight", ("shared_expert_gate", "kernel"),
                                (1, h), True)]
    else:
        i = c.intermediate_size
        out += [LayerTensor("mlp.gate_proj.weight", ("gate_proj", "kernel"), (i, h), True),
                LayerTensor("mlp.up_proj.weight", ("up_proj", "kernel"), (i, h), True),
                LayerTensor("mlp.down_proj.weight", ("down_proj", "kernel"), (h, i), True)]
    return out


def global_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (our key, HF shape) of the tensors outside the layers."""
    h = config.hidden_size
    out = {"model.embed_tokens.weight": ("embed", (config.vocab_size, h)),
           "model.norm.weight": ("final_norm", (h,))}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head", (config.vocab_size, h))
    return out


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes in HF layout for every (canonical) tensor name the model needs."""
    shapes = {name: shape for name, (_, shape) in global_tensors(c).items()}
    for i in range(c.num_layers):
        for t in layer_tensors(c):
            for e in range(c.num_experts if t.experts else 1):
                shapes[f"model.layers.{i}.{t.hf.format(e=e)}"] = t.shape
    return shapes


def _set(tree: dict, key: tuple[str, ...], value) -> None:
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    tree[key[-1]] = value


def _get(tree: dict, key: tuple[str, ...]):
    for k in key:
        tree = tree[k]
    return tree


def canonical_getter(config: ModelConfig, get: Getter) -> Getter:
    """`get` extended with the fused and per-expert layouts checkpoints also use."""
    nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size

    @functools.lru_cache(maxsize=4)
    def fused(name: str):  # a fused tensor serves several canonical names in a row
        return get(name)

    def resolve(name: str) -> np.ndarray | None:
        arr = get(name)
        if arr is not None:
            return arr
        prefix, _, suffix = name.rpartition(".self_attn.")
        if suffix in ("q_proj.weight", "k_proj.weight", "v_proj.weight") or \
                suffix in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
            kind = suffix.split(".")[1]
            whole = fused(f"{prefix}.self_attn.qkv_proj.{kind}")
            if whole is None:
                return None
            span = {"q": (0, nq), "k": (nq, nq + nkv), "v": (nq + nkv, nq + 2 * nkv)}[suffix[0]]
            return whole[span[0] : span[1]]
        prefix, _, suffix = name.rpartition(".mlp.")
        if suffix in ("gate_proj.weight", "up_proj.weight"):
            whole = fused(f"{prefix}.mlp.gate_up_proj.weight")
            if whole is None:
                return None
            return whole[:inter] if suffix.startswith("gate") else whole[inter:]
        if suffix == "gate.weight":
            return get(f"{prefix}.block_sparse_moe.gate.weight")
        parts = suffix.split(".")
        if len(parts) == 4 and parts[0] == "experts":
            e, proj = int(parts[1]), parts[2]
            old = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
            arr = get(f"{prefix}.block_sparse_moe.experts.{e}.{old}.weight")
            if arr is not None:
                return arr
            if proj == "down_proj":
                whole = fused(f"{prefix}.mlp.experts.down_proj")
                return None if whole is None else whole[e]
            whole = fused(f"{prefix}.mlp.experts.gate_up_proj")
            if whole is None:
                return None
            i = whole.shape[1] // 2
            return whole[e, :i] if proj == "gate_proj" else whole[e, i:]
        return None

    return resolve


# Projections fused in the unrolled layout (`models.decoder.FUSED_PROJECTIONS`): packed
# members of one group share a format, so their codes and scales concatenate.
PACKED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def canonical_packed_getter(config: ModelConfig, get: Callable) -> Callable:
    """`get(name) -> PackedWeight | None` (weights as ``[in, out]``) extended with fused
    checkpoint tensors (Phi-3's ``qkv_proj`` / ``gate_up_proj``), sliced by output column."""
    nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size

    def resolve(name: str):
        pw = get(name)
        if pw is not None:
            return pw
        prefix, _, suffix = name.rpartition(".self_attn.")
        if suffix in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            whole = get(f"{prefix}.self_attn.qkv_proj.weight")
            span = {"q": (0, nq), "k": (nq, nq + nkv), "v": (nq + nkv, nq + 2 * nkv)}[suffix[0]]
            return None if whole is None else whole.columns(slice(*span))
        prefix, _, suffix = name.rpartition(".mlp.")
        if suffix in ("gate_proj.weight", "up_proj.weight"):
            whole = get(f"{prefix}.mlp.gate_up_proj.weight")
            cols = slice(0, inter) if suffix.startswith("gate") else slice(inter, 2 * inter)
            return None if whole is None else whole.columns(cols)
        return None

    return resolve


def _packed_layers(config: ModelConfig, get_packed: Callable) -> dict[tuple[str, ...], list]:
    """The dense projections every layer of which the source keeps packed, as uniform
    per-layer `PackedWeight`s (`models.packed.repack`: mixed GGUF types across layers and
    across a fused group); the others (and MoE experts) load as floats."""
    from models.packed import repack

    found: dict[tuple[str, ...], list] = {}
    for t in layer_tensors(config):
        if not t.transpose or t.experts or t.key[-1] != "kernel":
            continue
        pws = [get_packed(f"model.layers.{i}.{t.hf}") for i in range(config.num_layers)]
        if all(pw is not None for pw in pws):
            want = t.shape[::-1]
            for pw in pws:
                if pw.shape != want:
                    raise WeightError(f"tensor {t.hf!r} has shape {pw.shape[::-1]}, expected "
                                      f"{t.shape}")
            found[t.key] = pws
    for group in PACKED_GROUPS:
        keys = [(name, "kernel") for name in group if (name, "kernel") in found]
        if not keys:
            continue
        if len(keys) < len(group) and all((n, "kernel") in {tt.key for tt in layer_tensors(config)}
                                          for n in group):
            for k in keys:  # a group fuses only when all its members share one form
                del found[k]
            continue
        flat = repack([pw for k in keys for pw in found[k]], same_shape=False)
        for j, k in enumerate(keys):
            found[k] = flat[j * config.num_layers : (j + 1) * config.num_layers]
    for k, pws in found.items():
        found[k] = repack(pws)
    return found


def assemble_params(config: ModelConfig, get: Getter, dtype=jnp.float32, *,
                    norms_offset_applied: bool = False, get_packed: Callable | None = None
                    ) -> dict:
    """Build the params pytree; `get(name)` returns the HF-layout array or None if absent.

    `norms_offset_applied`: the source already stores Gemma norms as ``1 + w`` (GGUF).
    `get_packed(name)`: a `models.packed.PackedWeight` (``[in, out]``) for tensors the source
    keeps quantized, or None; dense projections whose every layer it gives, and the embedding
    and LM head, stay packed in the params (`models.qlinear`), the rest loads as floats."""
    shapes = expected_shapes(config)
    get = canonical_getter(config, get)
    offset = 1.0 if gemma_norms(config) and not norms_offset_applied else 0.0
    packed = {}
    if get_packed is not None:
        get_packed = canonical_packed_getter(config, get_packed)
        packed = _packed_layers(config, get_packed)

    def fetch(name: str) -> np.ndarray:
        arr = get(name)
        if arr is None:
            raise WeightError(f"missing tensor {name!r}")
        if tuple(arr.shape) != shapes[name]:
            raise WeightError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shapes[name]}")
        return np.asarray(arr, dtype=np.float32)

    def one(i: int, t: LayerTensor) -> np.ndarray:
        def read(name: str) -> np.ndarray:
            arr = fetch(f"model.layers.{i}.{name}")
            arr = arr.T if t.transpose else arr
            return arr + offset if t.norm else arr

        if t.experts:
            return np.stack([read(t.hf.format(e=e)) for e in range(config.num_experts)])
        return read(t.hf)

    layers: dict = {}
    for t in layer_tensors(config):
        if t.key in packed:
            for leaf in packed[t.key][0].arrays():
                _set(layers, (*t.key[:-1], leaf), jnp.asarray(
                    np.stack([pw.arrays()[leaf] for pw in packed[t.key]])))
            continue
        stacked = np.stack([one(i, t) for i in range(config.num_layers)])
        _set(layers, t.key, jnp.asarray(stacked, dtype=dtype))
        del stacked
    params: dict = {"layers": layers}
    for name, (key, _) in global_tensors(config).items():
        pw = get_packed(name) if get_packed is not None and key != "final_norm" else None
        if pw is not None:  # the embedding too is kept as the LM head's [hidden, vocab]
            params[key] = {leaf: jnp.asarray(a) for leaf, a in pw.arrays().items()}
            continue
        arr = fetch(name)
        if key == "final_norm":
            arr = arr + offset
        params[key] = jnp.asarray(arr.T if key == "lm_head" else arr, dtype=dtype)
    return params


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> dict:
    """``jax.ShapeDtypeStruct`` tree of what `assemble_params` builds, without any memory
    (deviceless AOT compiles the step at 8B shapes from these)."""
    import jax

    spec = lambda shape: jax.ShapeDtypeStruct(tuple(shape), dtype)  # noqa: E731
    layers: dict = {}
    for t in layer_tensors(config):
        shape = t.shape[::-1] if t.transpose else t.shape
        if t.experts:
            shape = (config.num_experts, *shape)
        _set(layers, t.key, spec((config.num_layers, *shape)))
    params: dict = {"layers": layers}
    for key, shape in global_tensors(config).values():
        params[key] = spec(shape[::-1] if key == "lm_head" else shape)
    return params


def params_to_hf(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Inverse of `assemble_params`, in canonical HF names (used to write HF checkpoints in
    tests and tools)."""
    offset = 1.0 if gemma_norms(config) else 0.0
    out = {}
    for name, (key, _) in global_tensors(config).items():
        arr = np.asarray(params[key], np.float32)
        out[name] = arr.T if key == "lm_head" else (arr - offset if key == "final_norm" else arr)
    for t in layer_tensors(config):
        stacked = np.asarray(_get(params["layers"], t.key), np.float32)
        for i in range(config.num_layers):
            for e in range(config.num_experts if t.experts else 1):
                arr = stacked[i, e] if t.experts else stacked[i]
                arr = arr.T if t.transpose else arr
                out[f"model.layers.{i}.{t.hf.format(e=e)}"] = np.ascontiguousarray(
                    arr - offset if t.norm else arr)
    return out


def quantize_params_int8(config: ModelConfig, params: dict) -> dict:
    """Float params with their dense projections, embedding and LM head quantized to int8
    per output channel (`models.packed.quantize_int8_per_channel`; weights already packed and
    MoE experts are left as they are). The embedding becomes the LM head's ``[hidden, vocab]``
    layout, one scale per vocabulary row."""
    import jax

    from models.packed import quantize_int8_per_channel
    from models.qlinear import is_packed

    def pack(w) -> dict:
        w = np.asarray(jax.device_get(w), np.float32)
        return {k: jnp.asarray(a) for k, a in quantize_int8_per_channel(w).arrays().items()}

    def pack_stacked(w) -> dict:
        per_layer = [pack(x) for x in np.asarray(jax.device_get(w))]
        return {k: jnp.stack([p[k] for p in per_layer]) for k in per_layer[0]}

    layers = dict(params["layers"])
    for t in layer_tensors(config):
        if not t.transpose or t.experts or t.key[-1] != "kernel":
            continue
        sub = dict(_get(layers, t.key[:-1]))
        if "kernel" in sub:
            kernel = sub.pop("kernel")
            layers[t.key[0]] = {**sub, **pack_stacked(kernel)}
    out = {**params, "layers": layers}
    if not is_packed(params["embed"]):
        out["embed"] = pack(np.asarray(jax.device_get(params["embed"])).T)
    if "lm_head" in params and not is_packed(params["lm_head"]):
        out["lm_head"] = pack(params["lm_head"])
    return out
