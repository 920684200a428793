"""The step the engine runs on a GPU reads each layer's weights in place.

Under a layer `scan`, XLA slices every layer's weights out of the stacked parameters and
materializes the slice before its GEMMs, so the weights cross HBM three times per step (the
first H100 run: a Llama-3-8B decode step at 22-28 ms against ~11-15 ms for reading weights
and KV once). The engine therefore unrolls the loop on GPUs (`resolve_layer_loop`). The
step's scratch memory shows the difference: one layer's weights under the scan, activations
alone unrolled.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.weights import abstract_params
from pagedjax.aot.step import MODELS, compile_step, step_shapes


def _layer_mib(model: str) -> float:
    layers = abstract_params(MODELS[model], jnp.bfloat16)["layers"]
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(layers))
    return total / MODELS[model].num_layers / 2**20


def test_unrolled_gpu_step_copies_no_layer_weights():
    shapes = [s for s in step_shapes(2048) if s.name == "decode_b64"]
    rows = {loop: compile_step("llama3-8b", "h100", shapes=shapes, layer_loop=loop, log=lambda *_: None)[0]
            for loop in ("scan", "unrolled")}
    assert all(r["error"] is None for r in rows.values()), rows
    layer = _layer_mib("llama3-8b")  # ~416 MiB
    assert rows["scan"]["temp_mib"] >= 0.9 * layer, (rows["scan"]["temp_mib"], layer)  # the gate works
    assert rows["unrolled"]["temp_mib"] < 0.05 * layer, (rows["unrolled"]["temp_mib"], layer)
    # and unrolled is what the compile tier compiles for a GPU, whatever the suite's variable says
    default = compile_step("smollm2-135m", "h100", shapes=shapes[:1], log=lambda *_: None)[0]
    assert default["layer_loop"] == "unrolled"
