"""What the serving step's weight leaves cost its dispatch (the main thread's CPU per call).

    .venv/bin/python bench/dispatch_leaves.py [--calls 2000] [--rounds 3]

Builds the demo engine's CPU runner (fp32, unrolled layers: 182 weight leaves), then times a
jitted call that takes the runner's flat weight tuple and uses none of it
(``keep_unused=True``, so every leaf is still checked and handed to XLA) against the same call
over 8 small arrays, alternating, with `time.thread_time`. The difference is what stacking
each weight kind over the layers (~8 leaves, docs/v1-core.md "Fewer arguments for the serving
step") could save per step at most. Writes bench/results/cpu/dispatch_leaves.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def per_call_us(args: tuple, calls: int) -> float:
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda leaves, x: x + 1, keep_unused=True)
    x = jnp.ones((8,), jnp.float32)
    for _ in range(50):
        f(args, x).block_until_ready()
    t = time.thread_time()
    for _ in range(calls):
        y = f(args, x)
    y.block_until_ready()
    return (time.thread_time() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/dispatch_leaves.json"))
    args = ap.parse_args()

    import jax
    import numpy as np

    from pagedjax import LLM

    load0 = os.getloadavg()[0]
    llm = LLM("smollm2", dtype="float32", max_model_len=1024, cpu_kv_cache_gb=0.25)
    weights = llm.engine.runner._flat_params
    few = tuple(jax.device_put(np.ones(1000, np.float32)) for _ in range(8))
    rows = []
    for r in range(args.rounds):
        real, small = per_call_us(weights, args.calls), per_call_us(few, args.calls)
        rows.append({"round": r, "weights_us": round(real, 1), "eight_small_us": round(small, 1)})
        print(f"round {r}: {len(weights)} weight leaves {real:.1f} us, 8 small arrays "
              f"{small:.1f} us per call")
    out = {
        "what": "main-thread CPU per jitted call: the runner's weight leaves vs 8 small arrays",
        "leaves": len(weights),
        "rounds": rows,
        "median_difference_us": round(statistics.median(
            r["weights_us"] - r["eight_small_us"] for r in rows), 1),
        "load_avg_at_start": load0,
        "host": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "reproduce": "python bench/dispatch_leaves.py",
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"median difference {out['median_difference_us']} us -> {args.out}")


if __name__ == "__main__":
    main()
