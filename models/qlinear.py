"""Linear layers whose weights may be packed (`models.packed`): dequantized inside the step.

A packed weight is a params subtree ``{"codes", "scale"[, "offset"]}`` in place of a dense
``{"kernel"}``: ``codes`` ``[K, N]`` (int8 or uint8, one code per byte) or ``[K // 2, N]``
(uint8, two 4-bit codes per byte), ``scale`` and ``offset`` ``[K // group, N]``; the number of
bits and the group follow from the shapes and the layer's input width K. The weight is
rebuilt as ``code * scale + offset`` in float32, cast to the layer's dtype and used by the
same dot a dense kernel would, so a packed model computes the numbers the dequantized-float
path computes (tests compare logits). XLA fuses the unpacking with the dot's operand where
it can; the memory saved is the weights' resident bytes.

`Linear` is `flax.linen.Dense` with that alternative: the same param names and the same ops
for a dense kernel (bias included), so checkpoints and numerics are unchanged.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


def is_packed(p: Any) -> bool:
    return isinstance(p, dict) and "codes" in p


def dequantize(p: dict, k: int, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]`` weight from packed leaves (leading axes: stacked layers)."""
    codes, scale = p["codes"], p["scale"]
    n = codes.shape[-1]
    lead = codes.shape[:-2]
    if codes.shape[-2] * 2 == k:  # two 4-bit codes per byte, 32-element groups (models.packed)
        b = codes.reshape(*lead, k // 32, 16, n)
        q = jnp.concatenate([b & 15, b >> 4], axis=-2).reshape(*lead, k, n)
    elif codes.shape[-2] == k:
        q = codes
    else:
        raise ValueError(f"packed codes of shape {codes.shape} do not hold {k} input features")
    groups = scale.shape[-2]
    g = k // groups
    w = q.astype(jnp.float32).reshape(*lead, groups, g, n) * \
        scale.astype(jnp.float32).reshape(*lead, groups, 1, n)
    if "offset" in p:
        w = w + p["offset"].astype(jnp.float32).reshape(*lead, groups, 1, n)
    return w.reshape(*lead, k, n).astype(dtype)


PANEL = 64  # output columns per panel (`pallas_kernels/csrc/packed_matmul_cpu.cc`)


def is_panels(p: dict) -> bool:
    return p["codes"].ndim == 3


def to_panels(p: dict) -> dict:
    """A packed weight's leaves ``[rows, N]`` cut into 64-column panels ``[N / 64, rows, 64]``
    (N padded with zero codes and scales): the layout the native CPU kernel streams
    (`pallas_kernels/csrc/packed_matmul_cpu.cc` says why). Leading axes are not allowed:
    panels are made per layer (`panelize`)."""
    n = p["codes"].shape[-1]
    pad = -n % PANEL

    def cut(a):
        a = jnp.pad(a, ((0, 0), (0, pad)))
        return a.reshape(a.shape[0], -1, PANEL).transpose(1, 0, 2)

    return {name: cut(a) for name, a in p.items()}


def panelize(params: dict) -> dict:
    """Every 2-D packed weight of ``params`` in panels (per-layer params: the unrolled layout);
    stacked ``[L, ...]`` ones (the scanned layout) get panels per layer."""
    def walk(node):
        if is_packed(node):
            if node["codes"].ndim == 2:
                return to_panels(node)
            if node["codes"].ndim == 3 and not is_panels_stacked(node):
                per_layer = [to_panels({k: a[i] for k, a in node.items()})
                             for i in range(node["codes"].shape[0])]
                return {k: jnp.stack([q[k] for q in per_layer]) for k in node}
            return node
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(params)


def is_dense_panels(p: Any) -> bool:
    """A float weight kept in 64-column panels (`to_dense_panels`) in place of ``kernel``."""
    return isinstance(p, dict) and "panels" in p


def to_dense_panels(w: jax.Array) -> jax.Array:
    """A float32 weight ``[K, N]`` as 64-column panels ``[ceil(N / 64), K, 64]`` (N padded
    with zeros): each panel one contiguous stream, the layout the native CPU matmul reads
    (`pallas_kernels/csrc/dense_matmul_cpu.cc` says why)."""
    pad = -w.shape[1] % PANEL
    return jnp.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], -1, PANEL).transpose(1, 0, 2)


def dense_panel_rows(panels: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` of the weight's transpose, ``[len(rows), K]``: an embedding lookup from a
    tied ``[vocab, hidden]`` table kept as the LM head's panels."""
    return panels[rows // PANEL, :, rows % PANEL]


def dense_panelize(params: dict) -> dict:
    """Every per-layer float32 `Linear` kernel ``[K, N]`` of ``params`` (a dict holding
    ``kernel``) as ``{"panels"}``, and the LM head: a tied ``embed [V, H]`` or an untied
    ``lm_head [H, V]`` as the panels of ``[H, V]``. Only for the unrolled (per-layer)
    layout on one CPU device, where `pallas_kernels.cpu_native.dense_matmul_cpu` runs it."""
    def walk(node):
        if isinstance(node, dict):
            kernel = node.get("kernel")
            if (kernel is not None and getattr(kernel, "ndim", 0) == 2
                    and kernel.dtype == jnp.float32):
                return {**{k: v for k, v in node.items() if k != "kernel"},
                        "panels": to_dense_panels(kernel)}
            return {k: walk(v) for k, v in node.items()}
        return node

    out = walk(params)
    for name, transpose in (("embed", True), ("lm_head", False)):
        w = out.get(name)
        if w is not None and not isinstance(w, dict) and w.ndim == 2 and w.dtype == jnp.float32:
            out[name] = {"panels": to_dense_panels(w.T if transpose else w)}
    return out


def is_panels_stacked(p: dict) -> bool:
    return p["codes"].ndim == 4


def dequantize_columns(p: dict, cols: jax.Array, k: int, dtype=jnp.float32) -> jax.Array:
    """Rows ``cols`` of the weight's transpose, ``[len(cols), K]``: an embedding lookup from a
    packed ``[hidden, vocab]`` table (only the gathered columns are unpacked); canonical or
    panel layout."""
    if is_panels(p):
        sub = {name: a[cols // PANEL, :, cols % PANEL].T for name, a in p.items()}
    else:
        sub = {name: jnp.take(a, cols, axis=-1) for name, a in p.items()}
    return jnp.swapaxes(dequantize(sub, k, dtype), -1, -2)


def takes_silu_mul(matmul: Any) -> bool:
    """Whether a ``packed_matmul`` (or a `functools.partial` of one) has the silu * up epilogue."""
    return bool(getattr(getattr(matmul, "func", matmul), "silu_mul", False))


class Linear(nn.Module):
    """`nn.Dense` that also reads a packed weight (see the module docstring).

    ``packed_matmul(x, p, n)``: a kernel that multiplies by packed leaves ``p`` directly (the
    native CPU one, `pallas_kernels.cpu_native.packed_matmul_cpu`, whose weights are in 64-column
    panels: `panelize`); None: XLA dequantizes the weight and runs the dot.

    ``silu_mul``: the weight is an MLP's fused gate and up projection and the result is
    ``silu(gate) * up`` (``features / 2`` wide); float32 panels take it in the native matmul's
    epilogue when the kernel offers one (`pallas_kernels.cpu_native.dense_matmul_cpu`), every
    other weight computes the product and then the activation."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    packed_matmul: Any = None
    silu_mul: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if (self.silu_mul and not self.use_bias and self.has_variable("params", "panels")
                and takes_silu_mul(self.packed_matmul)):
            return self.packed_matmul(x.astype(jnp.float32),
                                      {"panels": self.get_variable("params", "panels")},
                                      self.features, silu_mul=True).astype(self.dtype)
        y = self._product(x)
        if self.silu_mul:
            half = self.features // 2
            y = nn.silu(y[..., :half]) * y[..., half:]
        return y

    def _product(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "panels"):  # float32 panels: the native CPU matmul
            y = self.packed_matmul(x.astype(jnp.float32),
                                   {"panels": self.get_variable("params", "panels")},
                                   self.features)
            if self.use_bias:
                y += self.get_variable("params", "bias").astype(y.dtype)
            return y.astype(self.dtype)
        if self.has_variable("params", "codes"):
            p = {n: self.get_variable("params", n) for n in ("codes", "scale", "offset")
                 if self.has_variable("params", n)}
            if self.packed_matmul is not None:
                y = self.packed_matmul(x.astype(self.dtype), p, self.features)
                if self.use_bias:
                    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,),
                                      self.param_dtype)
                    y += jnp.reshape(bias.astype(self.dtype), (1,) * (y.ndim - 1) + (-1,))
                return y
            kernel = dequantize(p, x.shape[-1], self.dtype)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(),
                                (x.shape[-1], self.features), self.param_dtype)
        bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,),
                           self.param_dtype) if self.use_bias else None)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
