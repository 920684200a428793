"""Kernel launches of a batch-1 GPU decode step, counted in the deviceless H100 compile's
thunk sequence: the fusions that cut them must keep cutting them.

A batch-1 8B step is a CUDA graph of small kernels whose own latency (~2 us each) is most
of the step's time beyond its matmuls (docs/gpu.md). Three changes cut 160 of its 646
launches (21 a layer -> 16): the flash-decoding split merge written elementwise
(`combine_splits`: 4 launches a layer -> 2), the residual add + RMSNorm kernel
(`pallas_kernels.add_rms_norm`: 3 a norm -> 2, the other being the o/down GEMM's split-K
sum, which XLA fused into the add before) and K and V handed to `write_kv` as one operand
(2 fusions -> 1)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from pagedjax.aot.launches import step_launches
from pagedjax.aot.resources import compile_launches, thunk_launches
from pagedjax.aot.target import compile_only_devices
from pagedjax.worker.model_runner import ENV_FUSED_NORM
from pallas_kernels import paged_decode_attention

from .test_resources import THUNKS


def test_thunk_launches_keep_order_and_repeats():
    text = THUNKS + THUNKS.replace("001:", "004:").replace("003:", "005:")
    assert thunk_launches(text) == ["loop_pad_fusion", "paged_decode_g16_c1x256"] * 2


def _decode_launches(num_kv_heads: int, pages: int) -> list[str]:
    device = compile_only_devices("h100")[0]
    sh = SingleDeviceSharding(device)
    f = jax.ShapeDtypeStruct
    q = f((1, 4 * num_kv_heads, 128), jnp.bfloat16, sharding=sh)
    cache = f((2, num_kv_heads, pages, 16, 128), jnp.bfloat16, sharding=sh)
    tables = f((1, pages), jnp.int32, sharding=sh)
    lens = f((1,), jnp.int32, sharding=sh)
    fn = jax.jit(lambda q, k, v, t, n: paged_decode_attention(
        q, k, v, t, n, scale=0.088, layer=1, backend="pallas"))
    with jax.default_device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return compile_launches(fn.lower(q, cache, cache, tables, lens))


@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_split_merge_takes_two_launches_after_the_decode_kernel(num_kv_heads):
    """A 4096-token context at batch 1 runs 32 splits (one a 128-token chunk) over 8 or 2 KV
    heads; what follows the kernel is the merge: the maximum over the splits, then one
    fusion for the weighted sums, the division and the slice to the query group (it was 3
    reductions and a slice)."""
    launches = _decode_launches(num_kv_heads, pages=256)
    at = [i for i, n in enumerate(launches) if n.startswith("paged_decode")]
    assert len(at) == 1, launches
    assert len(launches) - at[0] - 1 <= 2, launches


def _step_launches(monkeypatch, fused: str, layers: int = 2) -> list[str]:
    monkeypatch.setenv(ENV_FUSED_NORM, fused)
    return step_launches("llama3-8b", "h100", batch=1, context=4096, layers=layers,
                         vocab_size=4096)


def test_fused_norm_cuts_a_launch_a_norm_in_the_batch1_step(monkeypatch):
    """Two Llama-3-8B layers at batch 1: with the kernel each of the 2 x 2 + 1 norms is one
    launch (the first without an add), and each norm after an add costs one launch fewer
    than XLA's add (with the GEMM's split-K sum), sum and scale (two a layer: 64 of the 8B
    step's launches). The first norm gains nothing: XLA fused the embedding gather into it."""
    fused = _step_launches(monkeypatch, "auto")
    plain = _step_launches(monkeypatch, "0")
    assert sum(n.startswith("add_rms_norm") for n in fused) == 4
    assert sum(n.startswith("rms_norm") for n in fused) == 1
    assert not any("rms_norm" in n for n in plain)
    assert len(fused) <= len(plain) - 2 * 2, (len(fused), len(plain))


def test_a_batch1_layer_takes_at_most_15_launches(monkeypatch):
    """What a layer adds to the step (3 layers minus 2): the qkv GEMM; K rotated and V
    sliced, one fusion feeding `write_kv` its single K/V operand (two operands took a
    launch each); the rotated query padded to the kernel's rows; `write_kv`; the decode
    kernel; the merge's maximum and sum; the o GEMM and its split-K sum; add + norm; the
    gate-up GEMM; SiLU x up; the down GEMM and its split-K sum; add + norm. 21 before."""
    per_layer = len(_step_launches(monkeypatch, "auto", 3)) - len(
        _step_launches(monkeypatch, "auto", 2))
    assert per_layer <= 15, per_layer
