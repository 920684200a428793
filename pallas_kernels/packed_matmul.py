"""``x @ w`` for a packed weight (`models.packed`), dequantizing inside the kernel (Pallas).

Why a kernel: XLA dequantizes a packed weight into a full bf16 copy in its own fusion and
the GEMM reads that copy (checked on the deviceless H100 compile: a ``bf16[K, N]``
``loop_convert_fusion`` feeds the Triton GEMM), so a decode step moves the full-precision
weight through HBM. Here each program loads its codes tile, widens and scales it in
registers and feeds ``tl.dot`` directly: the weight crosses memory packed.

The grid is ``(M / block_m, N / block_n)``. A program walks K in steps of 32 rows, each as
two halves of 16 (``tl.dot`` takes K = 16): 8-bit codes are rows ``k0 .. k0 + 15`` and
``k0 + 16 .. k0 + 31``; 4-bit codes are one byte tile whose low nibbles are the first half and
high nibbles the second (the packing of `models.packed`), so a half never straddles a scale
group of 16 or more. ``w = code * scale + offset`` is formed in fp32 per half and cast to the
activations' dtype for the dot; accumulation is fp32. Rows past M and columns past N are
masked.

``packed_matmul_ref`` is the XLA reference (`models.qlinear.dequantize` and a dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import interpret_mode, resolve_backend, triton_params


def _dequantize(p: dict, k: int, dtype) -> jax.Array:
    codes, scale = p["codes"], p["scale"]
    n = codes.shape[-1]
    if codes.shape[0] * 2 == k:
        b = codes.reshape(k // 32, 16, n)
        q = jnp.concatenate([b & 15, b >> 4], axis=1).reshape(k, n)
    else:
        q = codes
    g = k // scale.shape[0]
    w = q.astype(jnp.float32).reshape(scale.shape[0], g, n) * scale.astype(jnp.float32)[:, None]
    if "offset" in p:
        w = w + p["offset"].astype(jnp.float32)[:, None]
    return w.reshape(k, n).astype(dtype)


@jax.jit
def packed_matmul_ref(x: jax.Array, p: dict) -> jax.Array:
    """XLA: the weight dequantized to ``x``'s dtype, then a dot (fp32 accumulation)."""
    return jnp.dot(x, _dequantize(p, x.shape[-1], x.dtype),
                   preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x_ref, codes_ref, scale_ref, *rest, four_bit: bool, has_offset: bool, m: int,
            k: int, n: int, group: int, block_m: int, block_n: int):
    offset_ref, out_ref = (rest[0], rest[1]) if has_offset else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * block_m + jnp.arange(block_m)
    cols = j * block_n + jnp.arange(block_n)
    row_ok, col_ok = rows < m, cols < n
    exact = x_ref.dtype == jnp.float32

    def half(k_first, codes_tile, acc):
        """acc += x[rows, k_first : k_first + 16] @ w(codes_tile [16, block_n])."""
        g = k_first // group
        sc = plgpu.load(scale_ref.at[g, pl.ds(j * block_n, block_n)], mask=col_ok, other=0)
        w = codes_tile.astype(jnp.float32) * sc.astype(jnp.float32)[None, :]
        if has_offset:
            off = plgpu.load(offset_ref.at[g, pl.ds(j * block_n, block_n)], mask=col_ok, other=0)
            w = w + off.astype(jnp.float32)[None, :]
        xt = plgpu.load(x_ref.at[pl.ds(i * block_m, block_m), pl.ds(k_first, 16)],
                        mask=row_ok[:, None], other=0)
        return acc + plgpu.dot(xt, w.astype(x_ref.dtype), allow_tf32=not exact)

    def body(step, acc):
        k0 = step * 32
        mask = col_ok[None, :]
        if four_bit:
            b = plgpu.load(codes_ref.at[pl.ds(k0 // 2, 16), pl.ds(j * block_n, block_n)],
                           mask=mask, other=0)
            acc = half(k0, b & 15, acc)
            return half(k0 + 16, b >> 4, acc)
        lo = plgpu.load(codes_ref.at[pl.ds(k0, 16), pl.ds(j * block_n, block_n)], mask=mask,
                        other=0)
        hi = plgpu.load(codes_ref.at[pl.ds(k0 + 16, 16), pl.ds(j * block_n, block_n)],
                        mask=mask, other=0)
        return half(k0 + 16, hi, half(k0, lo, acc))

    acc = lax.fori_loop(0, k // 32, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)],
                acc.astype(out_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def _packed_matmul_pallas(x, p, *, block_m: int, block_n: int, num_warps: int, num_stages: int,
                          interpret: bool):
    m, k = x.shape
    codes, scale = p["codes"], p["scale"]
    n = codes.shape[-1]
    four_bit = codes.shape[0] * 2 == k
    group = k // scale.shape[0]
    has_offset = "offset" in p
    kernel = functools.partial(_kernel, four_bit=four_bit, has_offset=has_offset, m=m, k=k, n=n,
                               group=group, block_m=block_m, block_n=block_n)
    args = [x, codes, scale] + ([p["offset"]] if has_offset else [])
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n)),
        in_specs=[whole] * len(args),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name=f"packed_matmul_{'q4' if four_bit else 'q8'}_g{group}_m{block_m}_n{block_n}"
             f"{'_off' if has_offset else ''}",
    )(*args)


def packed_matmul(x: jax.Array, p: dict, n: int | None = None, *, backend: str | None = None,
                  block_m: int | None = None, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2) -> jax.Array:
    """``x [..., K] @ w`` for packed leaves ``p`` (``codes``, ``scale``, optional ``offset``,
    canonical layout ``[rows, N]``). ``backend`` "pallas": the kernel (Triton on a GPU,
    interpreted elsewhere); otherwise the XLA reference. K must be a multiple of 32 and the
    scale group at least 16. ``n`` is accepted for the engine's matmul signature (the width
    is the codes')."""
    del n
    lead, k = x.shape[:-1], x.shape[-1]
    if k % 32 or k // p["scale"].shape[0] < 16:
        raise ValueError(f"packed_matmul: K={k} must be a multiple of 32 with scale groups of "
                         f"at least 16 rows")
    x2 = x.reshape(-1, k)
    if resolve_backend(backend) != "pallas":
        y = packed_matmul_ref(x2, p)
    else:
        bm = block_m or max(16, min(64, 1 << max(0, (x2.shape[0] - 1).bit_length())))
        y = _packed_matmul_pallas(x2, p, block_m=bm, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages, interpret=interpret_mode())
    return y.reshape(*lead, p["codes"].shape[-1])
