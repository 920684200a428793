"""Residual add and RMSNorm in one kernel: ``r = x + delta``, ``h = rms_norm(r) * w``.

Why a kernel for three lines of jnp: a GPU decode step at batch 1 compiles each norm to
three launches (the residual add, which also sums the previous GEMM's split-K partials; the
sum of squares, one thread block, because XLA folds the unit row away and its normalization
fusion wants a row axis; the scale), about 2 us each in the step's CUDA graph (docs/gpu.md).
One Pallas program per token row adds, sums and scales; the split-K sum stays XLA's, so a
norm takes 2 launches, not 3 (the deviceless H100 8B batch-1 step: 582 -> 518 launches,
`tests/aot/test_launch_count.py`; at batch 64 XLA's own normalization fusion was already one
kernel). `models.decoder.DecoderLM` takes it as ``norm_fn``
(`pagedjax.worker.model_runner.fused_norm_fn` picks it for single-device GPU runners).

Numerics follow `models.decoder.rms_norm` on ``x + delta``: the sum is rounded to the
activations' dtype (it is the residual stream), the norm runs in fp32 on that rounded value.
A hidden size that is not a power of two (Triton's blocks are) is zero-padded for the kernel:
the padding adds 0 to the sum of squares, which is divided by the real size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import next_pow2
from pallas_kernels.backend import interpret_mode, triton_params


def add_rms_norm_ref(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                     eps: float) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference: ``(x + delta, rms_norm(x + delta) * weight)``."""
    r = x if delta is None else x + delta.astype(x.dtype)
    rf = r.astype(jnp.float32)
    h = rf * jax.lax.rsqrt(jnp.mean(rf * rf, axis=-1, keepdims=True) + eps)
    return r, (h * weight.astype(jnp.float32)).astype(x.dtype)


def _kernel(*refs, eps: float, hidden: int, has_delta: bool):
    if has_delta:
        x_ref, d_ref, w_ref, h_ref, r_ref = refs
        r = (x_ref[...].astype(jnp.float32) + d_ref[...].astype(jnp.float32)).astype(
            r_ref.dtype)
        r_ref[...] = r
    else:
        x_ref, w_ref, h_ref = refs
        r = x_ref[...]
    rf = r.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(rf * rf) / hidden + eps)
    h_ref[...] = (rf * inv * w_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm_pallas(x, delta, weight, *, eps: float, interpret: bool):
    lead, hidden = x.shape[:-1], x.shape[-1]
    width = next_pow2(hidden)
    pad = ((0, 0), (0, width - hidden))
    rows = x.reshape(-1, hidden)
    ins = [rows] if delta is None else [rows, delta.astype(x.dtype).reshape(-1, hidden)]
    if width != hidden:
        ins = [jnp.pad(a, pad) for a in ins]
        weight = jnp.pad(weight, (0, width - hidden))
    n = rows.shape[0]
    row = pl.BlockSpec((None, width), lambda i: (i, 0))
    outs = jax.ShapeDtypeStruct((n, width), x.dtype)
    has_delta = delta is not None
    result = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), hidden=hidden, has_delta=has_delta),
        grid=(n,),
        in_specs=[row] * len(ins) + [pl.BlockSpec((width,), lambda i: (0,))],
        out_specs=[row, row] if has_delta else row,
        out_shape=[outs, outs] if has_delta else outs,
        interpret=interpret,
        # A row of up to 4096 is 32 values a thread at 4 warps; wider rows get more warps.
        compiler_params=triton_params(num_warps=min(16, max(4, width // 1024)), num_stages=1),
        name=f"add_rms_norm_h{width}" if has_delta else f"rms_norm_h{width}",
    )(*ins, weight)
    h, r = (result[0], result[1]) if has_delta else (result, None)
    h = h[:, :hidden].reshape(*lead, hidden)
    r = x if r is None else r[:, :hidden].reshape(*lead, hidden)
    return r, h


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                 eps: float) -> tuple[jax.Array, jax.Array]:
    """``(x + delta, rms_norm(x + delta) * weight)`` over the last axis, by the Pallas kernel
    (interpreted off a GPU). ``delta`` None: no add, the first output is ``x``."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: weight shape {weight.shape} does not match the "
                         f"hidden size {x.shape[-1]}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"add_rms_norm: delta shape {delta.shape} != x shape {x.shape}")
    return _add_rms_norm_pallas(x, delta, weight, eps=float(eps), interpret=interpret_mode())
