"""Routed mixture-of-experts MLP without a Python loop over experts.

Every token picks its top-k experts from a softmax router (Mixtral, Qwen2-MoE and Qwen3-MoE
all route this way: softmax over all experts in fp32, top-k, optionally renormalised to sum
to one). The (token, expert) assignments are sorted by expert so each expert's rows are one
contiguous segment, and the three expert projections run as grouped matmuls over those
segments (`jax.lax.ragged_dot`); the weighted expert outputs are scattered back onto their
tokens with a segment sum. The graph is the same for any routing.

What `ragged_dot` costs depends on XLA's lowering, and in jax 0.12 both XLA:CPU and XLA:GPU
(checked on a deviceless H100 compile) lower it densely: every sorted row against every
expert, masked, i.e. ``num_experts`` times the matmul work of the assignments
(`bench/families.py`: the MoE families decode at 0.15-0.19x the dense ones of the same width
on CPU). A grouped-GEMM kernel (Pallas, megablox-style) is what removes that. Until then,
when a step has fewer (token, expert) assignments than experts, which is every small-batch
decode of a model with many experts, the CPU path gathers each assignment's expert weights
and runs one matvec per assignment instead: it reads only the chosen experts' weights, which
is what bounds a decode step. The choice is static per compiled shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] fp32, expert ids [N, k] int32) of each token's top-k experts."""
    logits = jnp.einsum("nh,he->ne", x, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def use_gather(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the per-assignment gather formulation serves this shape (see module doc)."""
    from pallas_kernels.backend import target_platform

    return target_platform() == "cpu" and num_tokens * top_k < num_experts


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, top_k: int, renormalize: bool,
            act: Callable[[jax.Array], jax.Array], gather: bool | None = None) -> jax.Array:
    """x [N, H]; router [H, E]; w_gate, w_up [E, H, I]; w_down [E, I, H] -> [N, H].

    ``gather``: force the formulation (None: `use_gather`)."""
    n = x.shape[0]
    num_experts = router.shape[-1]
    weights, ids = route(x, router, top_k, renormalize)
    if gather is None:
        gather = use_gather(n, top_k, num_experts)
    return expert_outputs(x, weights, ids, w_gate, w_up, w_down, act, gather)


def expert_outputs(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, act: Callable[[jax.Array], jax.Array],
                   gather: bool) -> jax.Array:
    """Sum over each token's assignments of weight x expert MLP. ``ids`` may name experts
    past ``w_gate.shape[0]`` (another device's, under expert parallelism) when their weight
    is 0: those assignments sort last, outside every group, and contribute nothing."""
    n, top_k = ids.shape
    num_experts = w_gate.shape[0]
    if gather:
        return _gathered(x, weights, jnp.minimum(ids, num_experts - 1), w_gate, w_up, w_down,
                         act)
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # assignments grouped by expert
    tokens = order // top_k
    sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    rows = x[tokens]
    gate = jax.lax.ragged_dot(rows, w_gate, sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(rows, w_up, sizes, preferred_element_type=jnp.float32)
    h = (act(gate) * up).astype(x.dtype)
    out = jax.lax.ragged_dot(h, w_down, sizes, preferred_element_type=jnp.float32)
    out = out * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(out, tokens, num_segments=n).astype(x.dtype)


def _gathered(x, weights, ids, w_gate, w_up, w_down, act) -> jax.Array:
    """One matvec per (token, expert) assignment against that expert's gathered weights."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # [N*k, H], assignment a = token a // k
    gate = jnp.einsum("ah,ahi->ai", rows, w_gate[flat], preferred_element_type=jnp.float32)
    up = jnp.einsum("ah,ahi->ai", rows, w_up[flat], preferred_element_type=jnp.float32)
    h = (act(gate) * up).astype(x.dtype)
    out = jnp.einsum("ai,aih->ah", h, w_down[flat], preferred_element_type=jnp.float32)
    out = (out * weights.reshape(-1, 1)).reshape(n, k, -1).sum(axis=1)
    return out.astype(x.dtype)
