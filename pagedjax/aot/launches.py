"""Kernel launches of the engine's decode step, compiled deviceless for a GPU target.

A batch-1 decode step is a CUDA graph of small kernels, each costing its own latency (~2 us),
so their number is a cost the AOT reports do not show (they list distinct kernels). This
counts every launch in the thunk sequence XLA dumps for the step, by fusion name:

    JAX_PLATFORMS=cpu .venv-aot/bin/python -m pagedjax.aot.launches --batch 1 --context 4096

(docs/gpu.md "Fewer launches in the batch-1 step"; `tests/aot/test_launch_count.py`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from pagedjax.aot import step as aot_step  # noqa: E402
from pagedjax.aot.resources import compile_launches  # noqa: E402
from pagedjax.aot.target import compile_only_devices  # noqa: E402
from pagedjax.config import EngineConfig  # noqa: E402
from pagedjax.worker.model_runner import ModelRunner, default_layer_loop  # noqa: E402


def step_launches(model: str = "llama3-8b", target: str = "h100", batch: int = 1,
                  context: int = 4096, layers: int | None = None,
                  vocab_size: int | None = None) -> list[str]:
    """The launches, in order, of one decode step of ``batch`` sequences at ``context``
    tokens, as the engine builds it for one ``target`` GPU (its default layer loop, Pallas
    attention, $PAGEDJAX_FUSED_NORM as set). ``layers`` / ``vocab_size`` shrink the model
    (the tests' faster compiles)."""
    config = aot_step.MODELS[model]
    config = dataclasses.replace(config, num_layers=layers or config.num_layers,
                                 vocab_size=vocab_size or config.vocab_size)
    devices = compile_only_devices(target)
    # The engine configuration the AOT reports compile (`aot_step.compile_step`).
    ec = EngineConfig(block_size=16, attention_backend="pallas", num_gpu_blocks=1,
                      max_num_seqs=256, max_num_batched_tokens=2048,
                      layer_loop=default_layer_loop("gpu", 1))
    runner = ModelRunner.compile_only(config, ec, jnp.bfloat16, max(4096, context), devices)
    inputs, pages = aot_step._inputs(aot_step.StepShape("decode", ((1, context),) * batch),
                                     runner)
    params, k, v = runner.abstract_state(max(pages, 64))
    sh = SingleDeviceSharding(devices[0])
    host = (inputs.input_ids, inputs.positions, runner.step_meta(inputs.meta),
            inputs.logits_indices)
    args = jax.tree.map(lambda x: aot_step._abstract(jnp.asarray(x), sh), host)
    with jax.default_device(devices[0]), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return compile_launches(ModelRunner._step.lower(runner, params, k, v, *args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", choices=sorted(aot_step.MODELS))
    parser.add_argument("--target", default="h100")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    launches = step_launches(args.model, args.target, args.batch, args.context)
    # Fusion names carry XLA's numbering (loop_add_fusion_63): group by the stem.
    stems = collections.Counter(re.sub(r"(_\d+)+$", "", n) for n in launches)
    print(f"{args.model} on {args.target}, decode batch {args.batch} x {args.context}: "
          f"{len(launches)} launches")
    for name, n in stems.most_common():
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
