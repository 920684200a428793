"""Functional Flax (Linen) decoder: one core for every supported family.

Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3 and the MoE families differ in a few switches of
`ModelConfig` (biases, q/k norms, sandwich norms, GELU, soft-capping, sliding windows, a local
rotary base, routed experts), not in code paths of their own: a family is a config reader and a
weight-name map (`models.weights`), not a model file.

The decoder layers run either as one `nn.scan` over stacked parameters (`scan_layers=True`: the
compiled graph holds one layer body whatever the depth, so compiles are fast) or as a Python loop
over per-layer parameters (`scan_layers=False`). The loop is what serving on CPU wants: inside a
scan, XLA:CPU copies each layer's weight slice out of the stacked array before the matmul, so a
memory-bound decode step reads every weight twice and writes it once (measured: 16 vs 27 GB/s
on this project's 2-core machine). The loop's layout also fuses each layer's q/k/v projections
into one `qkv_proj` matmul and gate/up into one `gate_up_proj`: fewer, wider dots, 22 % less
projection time at one row, 4 % at 64 and none at 256 on that machine
(`bench/fused_projections.py`). Checkpoints and loaders keep the stacked, unfused layout;
`unstack_layers` converts once at load. In the loop each layer's window and rotary base are
Python constants; under the scan they are looked up by the traced layer index.

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
import functools
import os
from collections.abc import Callable
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import rope as rope_lib
from models.config import ModelConfig
from models.moe import moe_mlp
from models.qlinear import (
    Linear,
    dense_panel_rows,
    dequantize,
    dequantize_columns,
    is_dense_panels,
    is_packed,
    takes_silu_mul,
)

KVCache = tuple[jax.Array, jax.Array]


class AttentionFn(Protocol):
    """Attention over a KV cache for one layer.

    q: [..., num_heads, head_dim]; k, v: [..., num_kv_heads, head_dim] (rotary already applied).
    scale: softmax scale; window: sliding window in tokens (0: full attention; a Python int or
    a traced int32 scalar); softcap: attention logit soft-capping (None: off).
    Returns the attention output shaped like q, and the cache with this step's k/v written.
    """

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache,
                 layer: jax.Array, meta: Any, *, scale: float, window: int | jax.Array = 0,
                 softcap: float | None = None) -> tuple[jax.Array, KVCache]: ...


# ``(x, delta | None, weight, eps) -> (x + delta, rms_norm(x + delta) * weight)``.
NormFn = Callable[[jax.Array, jax.Array | None, jax.Array, float], tuple[jax.Array, jax.Array]]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32. Gemma's ``(1 + w)`` weights are stored with the 1 already added
    (`models.weights`), so one norm serves every family."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


def model_rotary_tables(config: ModelConfig, positions: jax.Array):
    """(global, local) cos/sin tables; local is None unless windowed layers have their own
    rotary base (Gemma 3)."""
    c = config
    glob = rope_lib.tables(positions, c.rotary_dim, c.rope_theta, c.rope_scaling,
                           c.max_position_embeddings)
    local = None
    if c.rope_local_theta is not None:
        local = rope_lib.tables(positions, c.rotary_dim, c.rope_local_theta, None,
                                c.max_position_embeddings)
    return glob, local


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half convention over the first ``2 * cos.shape[-1]`` features of each head
    (all of them unless the family rotates part of the head); the rest pass through."""
    half = cos.shape[-1]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half : 2 * half].astype(jnp.float32)
    cos = cos[..., None, :]
    sin = sin[..., None, :]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half :].astype(jnp.float32))
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    return nn.gelu(x, approximate=True) if name == "gelu_tanh" else nn.silu(x)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


class DecoderLayer(nn.Module):
    """One decoder layer; scanned over the layer axis by `DecoderLM` (or unrolled)."""

    config: ModelConfig
    attn_fn: Callable[..., tuple[jax.Array, KVCache]]
    dtype: Any = jnp.float32
    fused: bool = False  # params from `unstack_layers`: qkv_proj and gate_up_proj
    fused_shards: int = 1  # the fused columns are grouped per tensor-parallel shard
    static_layer: int | None = None  # the unrolled loop's layer index (window, rope known)
    moe_fn: Callable[..., jax.Array] | None = None  # routed experts (None: `moe_mlp`)
    packed_matmul: Callable[..., jax.Array] | None = None  # packed weights (`models.qlinear`)
    norm_fn: NormFn | None = None  # residual add + RMSNorm in one (`DecoderLM.norm_fn`)

    @nn.compact
    def __call__(self, carry, layer, rope, meta):
        x, kv_cache = carry
        pending = None
        if self.norm_fn is not None:
            # The previous layer's output rides in the carry unadded: the first norm adds it.
            x, pending = x
        c = self.config
        dense = lambda feats, name, bias=False: Linear(  # noqa: E731
            feats, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype,
            packed_matmul=self.packed_matmul, name=name)
        norm = lambda name, n=c.hidden_size: self.param(  # noqa: E731
            name, nn.initializers.ones, (n,), self.dtype)
        lead = x.shape[:-1]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        if self.norm_fn is not None:
            x, h = self.norm_fn(x, pending, norm("attn_norm"), c.rms_norm_eps)
        else:
            h = rms_norm(x, norm("attn_norm"), c.rms_norm_eps)
        if self.fused:
            qkv = dense(nq + 2 * nkv, "qkv_proj", c.qkv_bias)(h)
            q, k, v = split_fused(qkv, (nq, nkv, nkv), self.fused_shards)
        else:
            q = dense(nq, "q_proj", c.qkv_bias)(h)
            k = dense(nkv, "k_proj", c.qkv_bias)(h)
            v = dense(nkv, "v_proj", c.qkv_bias)(h)
        q = q.reshape(*lead, c.num_heads, c.head_dim)
        k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
        v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, norm("q_norm", c.head_dim), c.rms_norm_eps)
            k = rms_norm(k, norm("k_norm", c.head_dim), c.rms_norm_eps)
        window, (cos, sin) = self._window_and_rope(layer, rope)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attn, kv_cache = self.attn_fn(q, k, v, kv_cache, layer, meta, scale=c.softmax_scale,
                                      window=window, softcap=c.attn_softcap)
        attn = dense(c.hidden_size, "o_proj", c.o_bias)(attn.reshape(*lead, nq))
        if c.sandwich_norm:
            attn = rms_norm(attn, norm("post_attn_norm"), c.rms_norm_eps)
        if self.norm_fn is not None:
            x, h = self.norm_fn(x, attn, norm("mlp_norm"), c.rms_norm_eps)
        else:
            x = x + attn
            h = rms_norm(x, norm("mlp_norm"), c.rms_norm_eps)
        if c.num_experts:
            out = self._moe(h)
        else:
            if self.fused and self._silu_epilogue():
                act = Linear(2 * c.intermediate_size, dtype=self.dtype, param_dtype=self.dtype,
                             packed_matmul=self.packed_matmul, silu_mul=True,
                             name="gate_up_proj")(h)
            else:
                if self.fused:
                    gate_up = dense(2 * c.intermediate_size, "gate_up_proj")(h)
                    gate, up = split_fused(gate_up, (c.intermediate_size,) * 2,
                                           self.fused_shards)
                else:
                    gate = dense(c.intermediate_size, "gate_proj")(h)
                    up = dense(c.intermediate_size, "up_proj")(h)
                act = activation(c.hidden_act, gate) * up
            out = dense(c.hidden_size, "down_proj")(act)
        if c.sandwich_norm:
            out = rms_norm(out, norm("post_mlp_norm"), c.rms_norm_eps)
        if self.norm_fn is not None:
            return ((x, out), kv_cache), None
        return (x + out, kv_cache), None

    def _silu_epilogue(self) -> bool:
        """silu(gate) * up inside the gate_up matmul (`models.qlinear.Linear.silu_mul`): a silu
        MLP, one shard, a kernel with the epilogue (the native CPU matmul over float32 panels;
        a 64-row demo-model step lost XLA's 55 us silu * up thunk per layer) and whole panels
        per half. PAGEDJAX_SILU_EPILOGUE=0: the separate activation, for comparisons."""
        c = self.config
        return (c.hidden_act == "silu" and self.fused_shards == 1
                and takes_silu_mul(self.packed_matmul) and c.intermediate_size % 64 == 0
                and os.environ.get("PAGEDJAX_SILU_EPILOGUE", "1") != "0")

    def _window_and_rope(self, layer, rope):
        """This layer's sliding window and cos/sin tables: constants when unrolled, looked up
        by the traced layer index under the scan."""
        c = self.config
        glob, local = rope
        if not c.layer_windows:
            return 0, glob
        if self.static_layer is not None:
            w = c.windows[self.static_layer]
            return w, (local if (w and local is not None) else glob)
        w = jnp.asarray(c.windows, jnp.int32)[layer]
        if local is None:
            return w, glob
        return w, tuple(jnp.where(w > 0, lt, gt) for lt, gt in zip(local, glob, strict=True))

    def _moe(self, h):
        c = self.config
        hidden, inter, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
        init = nn.initializers.normal(0.02)
        router = self.param("router", init, (hidden, e), self.dtype)
        w_gate = self.param("expert_gate", init, (e, hidden, inter), self.dtype)
        w_up = self.param("expert_up", init, (e, hidden, inter), self.dtype)
        w_down = self.param("expert_down", init, (e, inter, hidden), self.dtype)
        flat = h.reshape(-1, hidden)
        out = (self.moe_fn or moe_mlp)(flat, router, w_gate, w_up, w_down, top_k=c.num_experts_per_tok,
                      renormalize=c.norm_topk_prob,
                      act=lambda x: activation(c.hidden_act, x))
        if c.shared_expert_intermediate_size:
            si = c.shared_expert_intermediate_size
            dense = lambda feats, name: Linear(feats, use_bias=False, dtype=self.dtype,  # noqa: E731
                                               param_dtype=self.dtype,
                                               packed_matmul=self.packed_matmul, name=name)
            shared = dense(hidden, "shared_down_proj")(
                activation(c.hidden_act, dense(si, "shared_gate_proj")(flat))
                * dense(si, "shared_up_proj")(flat))
            gate = jax.nn.sigmoid(dense(1, "shared_expert_gate")(flat).astype(jnp.float32))
            out = out + (gate * shared.astype(jnp.float32)).astype(out.dtype)
        return out.reshape(h.shape)


class DecoderLM(nn.Module):
    """Decoder with LM head. Call with `apply({"params": params}, ...)`."""

    config: ModelConfig
    attn_fn: Callable[..., tuple[jax.Array, KVCache]]
    dtype: Any = jnp.float32
    scan_layers: bool = True  # False: params from `unstack_layers`, one graph node per layer
    fused_shards: int = 1  # `unstack_layers(shards=)`: the tensor-parallel degree
    moe_fn: Callable[..., jax.Array] | None = None  # e.g. `parallel.experts.ExpertParallelMoE`
    # Multiplies by a packed weight directly (`models.qlinear.Linear`); None: XLA dequantizes.
    packed_matmul: Callable[..., jax.Array] | None = None
    # ``(x, delta | None, weight, eps) -> (x + delta, rms_norm(x + delta) * weight)`` in one
    # (`pallas_kernels.add_rms_norm`, on GPUs); None: `rms_norm` after XLA's add. With it, each
    # layer hands its output to the next unadded (the carry's residual is a pair), so every
    # add meets a norm.
    norm_fn: NormFn | None = None

    @nn.compact
    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, meta: Any,
                 logits_indices: jax.Array | None = None, return_hidden: bool = False
                 ) -> tuple[jax.Array, KVCache]:
        """Returns fp32 logits ([..., vocab] or [len(logits_indices), vocab]) and the new cache.

        `logits_indices` picks rows of the flattened token axis before the LM head, so a
        step computes vocab logits only for the tokens that are sampled. ``return_hidden``:
        those rows' final hidden states instead of their logits (the caller applies the LM
        head: `ModelRunner.head_outside`, where greedy rows skip most of it).
        """
        c = self.config
        # A packed table (`models.qlinear`) is stored as the LM head's [hidden, vocab].
        stored = (self.get_variable("params", "embed") if self.has_variable("params", "embed")
                  else None)
        packed_embed, panel_embed = is_packed(stored), is_dense_panels(stored)
        if packed_embed:
            embed = stored
            x = dequantize_columns(embed, input_ids.reshape(-1), c.hidden_size, self.dtype)
            x = x.reshape(*input_ids.shape, c.hidden_size)
        elif panel_embed:  # kept as the LM head's panels (`models.qlinear.dense_panelize`)
            embed = stored
            x = dense_panel_rows(embed["panels"], input_ids.reshape(-1)).astype(self.dtype)
            x = x.reshape(*input_ids.shape, c.hidden_size)
        else:
            embed = self.param("embed", nn.initializers.normal(0.02),
                               (c.vocab_size, c.hidden_size), self.dtype)
            x = embed[input_ids].astype(self.dtype)
        if c.embed_scale:  # Gemma; HF rounds the factor to the activation dtype first
            x = x * jnp.asarray(c.hidden_size ** 0.5, self.dtype)
        rope = model_rotary_tables(c, positions)
        if self.norm_fn is not None:
            # The residual and the output not yet added to it; a scan's carry needs an array.
            x = (x, jnp.zeros_like(x) if self.scan_layers else None)

        if self.scan_layers:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast),
                length=c.num_layers,
            )(c, self.attn_fn, self.dtype, moe_fn=self.moe_fn, packed_matmul=self.packed_matmul,
              norm_fn=self.norm_fn, name="layers")
            (x, kv_cache), _ = layers((x, kv_cache), jnp.arange(c.num_layers, dtype=jnp.int32),
                                      rope, meta)
        else:
            carry = (x, kv_cache)
            matmul = self.packed_matmul
            live = live_tokens(meta)
            if (live is not None and getattr(matmul, "takes_live_rows", False)
                    and os.environ.get("PAGEDJAX_LIVE_ROWS", "1") != "0"):
                # Padding tokens past the step's real ones cost no matmul work (their rows
                # come back as zeros, and padding only ever reads its own rows).
                # PAGEDJAX_LIVE_ROWS=0: every padded row (bench/offline_throughput.py's
                # `pagedjax-all-rows`).
                matmul = functools.partial(matmul, live_rows=live)
            # The tables once for all layers: without the barrier XLA fuses their cos/sin
            # into every layer's rotary fusions (four per layer, each recomputing them: 3.5 ms
            # of a 64-row CPU decode step; docs/v1-core.md, stop 83). Only with the native CPU
            # matmul, where it was measured: GPU steps (and their committed AOT reports) keep
            # XLA's fusion choices. PAGEDJAX_ROPE_ONCE=0: as before, for comparisons
            # (`bench/inprocess_ab.py`).
            if (getattr(self.packed_matmul, "takes_live_rows", False)
                    and os.environ.get("PAGEDJAX_ROPE_ONCE", "1") != "0"):
                rope = jax.lax.optimization_barrier(rope)
            for i in range(c.num_layers):
                layer = DecoderLayer(c, self.attn_fn, self.dtype, fused=True,
                                     fused_shards=self.fused_shards, static_layer=i,
                                     moe_fn=self.moe_fn, packed_matmul=matmul,
                                     norm_fn=self.norm_fn, name=f"{UNSTACKED_PREFIX}{i}")
                carry, _ = layer(carry, jnp.int32(i), rope, meta)
            x, kv_cache = carry

        final_norm = self.param("final_norm", nn.initializers.ones, (c.hidden_size,), self.dtype)
        if self.norm_fn is not None:
            x, pending = x
            if logits_indices is not None:  # rows first: the norm is per row
                x = x.reshape(-1, c.hidden_size)[logits_indices]
                pending = pending.reshape(-1, c.hidden_size)[logits_indices]
            x = self.norm_fn(x, pending, final_norm, c.rms_norm_eps)[1]
        else:
            x = rms_norm(x, final_norm, c.rms_norm_eps)
            if logits_indices is not None:
                x = x.reshape(-1, c.hidden_size)[logits_indices]
        if return_hidden:
            return x, kv_cache
        # The LM head: the (tied) embedding [V, H], an untied [H, V], or either packed.
        untied = (self.get_variable("params", "lm_head")
                  if self.has_variable("params", "lm_head") else None)
        if c.tie_word_embeddings:
            head, layout = embed, ("packed" if packed_embed or panel_embed else "vh")
        elif is_packed(untied) or is_dense_panels(untied):
            head, layout = untied, "packed"
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02),
                              (c.hidden_size, c.vocab_size), self.dtype)
            layout = "hv"
        if layout == "packed" and self.packed_matmul is not None:
            logits = self.packed_matmul(x, head, c.vocab_size)
        else:
            if layout == "packed":
                head, layout = dequantize(head, c.hidden_size, self.dtype), "hv"
            logits = jnp.einsum("...h,vh->...v" if layout == "vh" else "...h,hv->...v", x, head,
                                preferred_element_type=jnp.float32)
        return softcap(logits.astype(jnp.float32), c.final_softcap), kv_cache


UNSTACKED_PREFIX = "layer_"


def live_tokens(meta: Any) -> jax.Array | None:
    """A paged step's real token count, ``cu_q_lens[num_seqs]`` (its tokens come first, the
    bucket's padding after them); None for metadata without a ragged layout."""
    cu, n = getattr(meta, "cu_q_lens", None), getattr(meta, "num_seqs", None)
    if cu is None or n is None:
        return None
    return jnp.asarray(cu)[jnp.asarray(n)]


# Projections the per-layer layout fuses: fused name -> checkpoint names, in output order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}


def split_fused(y: jax.Array, widths: tuple[int, ...], shards: int = 1) -> list[jax.Array]:
    """The outputs of a fused projection (`unstack_layers`), in `FUSED_PROJECTIONS` order.

    With ``shards`` > 1 the columns are grouped per tensor-parallel shard (shard 0's q, k, v,
    then shard 1's, ...), so each device's slice of the fused output holds its own heads and
    the split needs no data from another device."""
    lead = y.shape[:-1]
    y = y.reshape(*lead, shards, y.shape[-1] // shards)
    out, at = [], 0
    for w in widths:
        out.append(y[..., at : at + w // shards].reshape(*lead, w))
        at += w // shards
    return out


def unstack_layers(params: dict, shards: int = 1) -> dict:
    """Stacked checkpoint params (``params["layers"]`` with a leading layer axis) to the
    per-layer layout of ``DecoderLM(scan_layers=False)``: ``layer_0 .. layer_{L-1}``,
    with each layer's projections fused (`FUSED_PROJECTIONS`: kernels, and biases where the
    family has them, concatenated along the output axis; MoE layers have no dense gate/up).
    Under tensor parallelism (``shards`` devices, columns sharded) the concatenation is per
    shard (`split_fused`), and each fused matrix keeps its parts' sharding: a plain
    concatenation would put q columns on the devices that hold k and v.

    Works on arrays (each layer becomes its own buffer, so the stacked original can be freed)
    and on ShapeDtypeStructs (for compile-only lowering)."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]

    def take(a, i):
        if isinstance(a, jax.ShapeDtypeStruct):
            sh = getattr(a, "sharding", None)
            if isinstance(sh, jax.sharding.NamedSharding):  # the layer axis leaves the spec
                sh = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:]))
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sh)
        return a[i]

    def concat(parts):
        if isinstance(parts[0], jax.ShapeDtypeStruct):
            width = sum(p.shape[-1] for p in parts)
            return jax.ShapeDtypeStruct((*parts[0].shape[:-1], width), parts[0].dtype,
                                        sharding=getattr(parts[0], "sharding", None))
        if shards == 1:
            return jnp.concatenate(parts, axis=-1)
        lead = parts[0].shape[:-1]
        grouped = [p.reshape(*lead, shards, p.shape[-1] // shards) for p in parts]
        fused = jnp.concatenate(grouped, axis=-1).reshape(*lead, -1)
        sh = getattr(parts[0], "sharding", None)
        return jax.device_put(fused, sh) if isinstance(sh, jax.sharding.NamedSharding) else fused

    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        layer = {k: jax.tree.map(lambda a, i=i: take(a, i), v) for k, v in stacked.items()}
        for fused, names in FUSED_PROJECTIONS.items():
            if names[0] not in layer:
                continue
            parts = [layer.pop(n) for n in names]
            layer[fused] = {key: concat([p[key] for p in parts]) for key in parts[0]}
        out[f"{UNSTACKED_PREFIX}{i}"] = layer
    return out


# ---------------------------------------------------------------------------------------------
# Contiguous KV cache: the reference generator's attention (one region of max_len per sequence).


@dataclasses.dataclass(frozen=True)
class ContiguousMeta:
    """positions: [batch, seq] int32 position of every query token; -1 marks padding."""

    positions: jax.Array


jax.tree_util.register_dataclass(ContiguousMeta, data_fields=["positions"], meta_fields=[])


def init_contiguous_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class ContiguousAttention:
    """Attention over a contiguous cache `[layers, batch, max_len, kv_heads, head_dim]`.

    Each token writes its k/v at its own position; a query at position p attends to cache
    slots 0..p of its row (the last `window` of them when windowed). Padding tokens
    (position -1) write nothing.
    """

    def __call__(self, q, k, v, kv_cache: KVCache, layer, meta: ContiguousMeta, *,
                 scale: float, window=0, softcap: float | None = None):
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
        scores = jnp.einsum("bskgd,btkd->bkgst", qf, keys) * scale
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        kv_pos = jnp.arange(max_len)[None, None, :]
        mask = kv_pos <= pos[:, :, None]  # [b, s, t]
        win = jnp.asarray(window, jnp.int32)
        mask &= (win <= 0) | (kv_pos > pos[:, :, None] - win)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no keys (padding) -> 0
        out = jnp.einsum("bkgst,btkd->bskgd", probs, vals).reshape(b, s, hkv * g, d)
        return out.astype(q.dtype), (k_cache, v_cache)
