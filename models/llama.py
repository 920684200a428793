"""Functional Flax (Linen) Llama.

The decoder layers run either as one `nn.scan` over stacked parameters (`scan_layers=True`: the
compiled graph holds one layer body whatever the depth, so compiles are fast) or as a Python loop
over per-layer parameters (`scan_layers=False`). The loop is what serving on CPU wants: inside a
scan, XLA:CPU copies each layer's weight slice out of the stacked array before the matmul, so a
memory-bound decode step reads every weight twice and writes it once (measured: 16 vs 27 GB/s
on this project's 2-core machine). The loop's layout also fuses each layer's q/k/v projections
into one `qkv_proj` matmul and gate/up into one `gate_up_proj`: fewer, wider dots, 22 % less
projection time at one row, 4 % at 64 and none at 256 on that machine
(`bench/fused_projections.py`). Checkpoints and loaders keep the stacked, unfused layout;
`unstack_layers` converts once at load.

Attention goes through a narrow, swappable `AttentionFn`: the model computes q/k/v and rotary
embeddings, and hands them with the KV-cache state and per-step metadata to that function,
which writes the new K/V into its cache and returns the attention output. The reference
generator plugs in a contiguous cache (`ContiguousAttention`); the paged engine plugs in the
Pallas paged kernels, without touching this file.

Input tokens may have any leading shape (`[batch, seq]` for the contiguous cache, a flat
`[num_tokens]` ragged batch for the paged engine); only the attention function interprets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import LlamaConfig

KVCache = tuple[jax.Array, jax.Array]


class AttentionFn(Protocol):
    """Attention over a KV cache for one layer.

    q: [..., num_heads, head_dim]; k, v: [..., num_kv_heads, head_dim] (rotary already applied).
    Returns the attention output shaped like q, and the cache with this step's k/v written.
    """

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache,
                 layer: jax.Array, meta: Any) -> tuple[jax.Array, KVCache]: ...


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


def rotary_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., head_dim/2] for the given integer positions (fp32)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half convention: the head is split into two halves, not interleaved pairs."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    cos = cos[..., None, :]
    sin = sin[..., None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class LlamaLayer(nn.Module):
    """One decoder layer; scanned over the layer axis by `LlamaForCausalLM`."""

    config: LlamaConfig
    attn_fn: Callable[..., tuple[jax.Array, KVCache]]
    dtype: Any = jnp.float32
    fused: bool = False  # params from `unstack_layers`: qkv_proj and gate_up_proj

    @nn.compact
    def __call__(self, carry, layer, rope, meta):
        x, kv_cache = carry
        c = self.config
        dense = lambda feats, name: nn.Dense(feats, use_bias=False, dtype=self.dtype,
                                             param_dtype=self.dtype, name=name)
        norm = lambda name: self.param(name, nn.initializers.ones, (c.hidden_size,), self.dtype)
        lead = x.shape[:-1]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        h = rms_norm(x, norm("attn_norm"), c.rms_norm_eps)
        if self.fused:
            qkv = dense(nq + 2 * nkv, "qkv_proj")(h)
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
        else:
            q, k, v = dense(nq, "q_proj")(h), dense(nkv, "k_proj")(h), dense(nkv, "v_proj")(h)
        q = q.reshape(*lead, c.num_heads, c.head_dim)
        k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
        v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attn, kv_cache = self.attn_fn(q, k, v, kv_cache, layer, meta)
        x = x + dense(c.hidden_size, "o_proj")(attn.reshape(*lead, c.num_heads * c.head_dim))

        h = rms_norm(x, norm("mlp_norm"), c.rms_norm_eps)
        if self.fused:
            gate_up = dense(2 * c.intermediate_size, "gate_up_proj")(h)
            gate, up = gate_up[..., : c.intermediate_size], gate_up[..., c.intermediate_size :]
        else:
            gate = dense(c.intermediate_size, "gate_proj")(h)
            up = dense(c.intermediate_size, "up_proj")(h)
        x = x + dense(c.hidden_size, "down_proj")(nn.silu(gate) * up)
        return (x, kv_cache), None


class LlamaForCausalLM(nn.Module):
    """Llama decoder with LM head. Call with `apply({"params": params}, ...)`."""

    config: LlamaConfig
    attn_fn: Callable[..., tuple[jax.Array, KVCache]]
    dtype: Any = jnp.float32
    scan_layers: bool = True  # False: params from `unstack_layers`, one graph node per layer

    @nn.compact
    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, meta: Any,
                 logits_indices: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Returns fp32 logits ([..., vocab] or [len(logits_indices), vocab]) and the new cache.

        `logits_indices` picks rows of the flattened token axis before the LM head, so a
        step computes vocab logits only for the tokens that are sampled.
        """
        c = self.config
        embed = self.param("embed", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                           self.dtype)
        x = embed[input_ids].astype(self.dtype)
        inv_freq = jnp.asarray(c.rope_inv_freq())
        rope = rotary_tables(positions, inv_freq)

        if self.scan_layers:
            layers = nn.scan(
                LlamaLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast),
                length=c.num_layers,
            )(c, self.attn_fn, self.dtype, name="layers")
            (x, kv_cache), _ = layers((x, kv_cache), jnp.arange(c.num_layers, dtype=jnp.int32),
                                      rope, meta)
        else:
            carry = (x, kv_cache)
            for i in range(c.num_layers):
                layer = LlamaLayer(c, self.attn_fn, self.dtype, fused=True,
                                   name=f"{UNSTACKED_PREFIX}{i}")
                carry, _ = layer(carry, jnp.int32(i), rope, meta)
            x, kv_cache = carry

        x = rms_norm(x, self.param("final_norm", nn.initializers.ones, (c.hidden_size,), self.dtype),
                     c.rms_norm_eps)
        if logits_indices is not None:
            x = x.reshape(-1, c.hidden_size)[logits_indices]
        if c.tie_word_embeddings:
            logits = jnp.einsum("...h,vh->...v", x, embed, preferred_element_type=jnp.float32)
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size),
                              self.dtype)
            logits = jnp.einsum("...h,hv->...v", x, head, preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32), kv_cache


UNSTACKED_PREFIX = "layer_"


# Projections the per-layer layout fuses: fused name -> checkpoint names, in output order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}


def unstack_layers(params: dict) -> dict:
    """Stacked checkpoint params (``params["layers"]`` with a leading layer axis) to the
    per-layer layout of ``LlamaForCausalLM(scan_layers=False)``: ``layer_0 .. layer_{L-1}``,
    with each layer's projections fused (`FUSED_PROJECTIONS`: kernels concatenated along the
    output axis).

    Works on arrays (each layer becomes its own buffer, so the stacked original can be freed)
    and on ShapeDtypeStructs (for compile-only lowering)."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]

    def take(a, i):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=getattr(a, "sharding", None))
        return a[i]

    def concat(parts):
        if isinstance(parts[0], jax.ShapeDtypeStruct):
            width = sum(p.shape[-1] for p in parts)
            return jax.ShapeDtypeStruct((*parts[0].shape[:-1], width), parts[0].dtype,
                                        sharding=getattr(parts[0], "sharding", None))
        return jnp.concatenate(parts, axis=-1)

    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        layer = {k: jax.tree.map(lambda a, i=i: take(a, i), v) for k, v in stacked.items()}
        for fused, names in FUSED_PROJECTIONS.items():
            layer[fused] = {"kernel": concat([layer.pop(n)["kernel"] for n in names])}
        out[f"{UNSTACKED_PREFIX}{i}"] = layer
    return out


# ---------------------------------------------------------------------------------------------
# Contiguous KV cache: the reference generator's attention (one region of max_len per sequence).


@dataclasses.dataclass(frozen=True)
class ContiguousMeta:
    """positions: [batch, seq] int32 position of every query token; -1 marks padding."""

    positions: jax.Array


jax.tree_util.register_dataclass(ContiguousMeta, data_fields=["positions"], meta_fields=[])


def init_contiguous_cache(config: LlamaConfig, batch: int, max_len: int, dtype: Any) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class ContiguousAttention:
    """Attention over a contiguous cache `[layers, batch, max_len, kv_heads, head_dim]`.

    Each token writes its k/v at its own position; a query at position p attends to cache
    slots 0..p of its row. Padding tokens (position -1) write nothing.
    """

    def __call__(self, q, k, v, kv_cache: KVCache, layer, meta: ContiguousMeta):
        k_cache, v_cache = kv_cache
        b, s = meta.positions.shape
        max_len = k_cache.shape[2]
        pos = meta.positions
        write_pos = jnp.where(pos >= 0, pos, max_len)  # out of range -> dropped
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
        k_cache = k_cache.at[layer, rows, write_pos].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[layer, rows, write_pos].set(v.astype(v_cache.dtype), mode="drop")
        keys = k_cache[layer].astype(jnp.float32)  # [b, max_len, hkv, d]
        vals = v_cache[layer].astype(jnp.float32)
        hkv, d = keys.shape[2], keys.shape[3]
        g = q.shape[-2] // hkv
        qf = q.astype(jnp.float32).reshape(b, s, hkv, g, d)
        scores = jnp.einsum("bskgd,btkd->bkgst", qf, keys) / jnp.sqrt(jnp.float32(d))
        mask = jnp.arange(max_len)[None, None, :] <= pos[:, :, None]  # [b, s, t]
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no keys (padding) -> 0
        out = jnp.einsum("bkgst,btkd->bskgd", probs, vals).reshape(b, s, hkv * g, d)
        return out.astype(q.dtype), (k_cache, v_cache)
