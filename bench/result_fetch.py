"""A step's sampler output to the host on one CPU device: `jax.device_get` against reading
each array in place (`ModelRunner.fetch`, `read_in_place`), the engine's one host sync a step.

The bench's stub engine (`bench/host_overhead.py`) returns numpy arrays, so it cannot see this
cost; here a jitted function makes a `SamplerOutput` of the engine's shapes (``--rows``, top-k
width ``--k``), and each call makes a fresh one and fetches it. The three ways take turns
call by call (A, B, C, A, B, C, ...): "ready" only waits for the arrays (what any fetch must
pay), so "fetch - ready" is a method's own host time.

    .venv/bin/python bench/result_fetch.py [--rows 256] [--calls 2000] [--reps 3]

Writes bench/results/cpu/result_fetch.json (median µs per call, per rep, with the load
average) and its plot, result_fetch.png.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--k", type=int, default=1, help="top-k width of the output")
    ap.add_argument("--calls", type=int, default=2000, help="calls per way per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/result_fetch.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from pagedjax.sampler import SamplerOutput
    from pagedjax.worker.model_runner import read_in_place

    b, k = args.rows, args.k

    @jax.jit
    def step(x):  # a sampler output's five arrays, made on the device
        return SamplerOutput(x.astype(jnp.int32), -x, (x > 0).astype(jnp.int32),
                             jnp.broadcast_to(-x[:, None], (b, k)),
                             jnp.broadcast_to(x[:, None].astype(jnp.int32), (b, k)), None)

    x = jnp.arange(b, dtype=jnp.float32)
    ways = {
        "device_get": lambda o: jax.device_get((o, None, None)),
        "read_in_place": lambda o: read_in_place((o, None, None)),
        "ready": jax.block_until_ready,
    }
    for f in ways.values():  # compile and warm each
        for _ in range(50):
            f(step(x))
    reps = []
    for _ in range(args.reps):
        load = os.getloadavg()[0]
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.calls):
            for w, f in ways.items():
                t = time.perf_counter()
                f(step(x))
                times[w].append(1e6 * (time.perf_counter() - t))
        med = {w: statistics.median(v) for w, v in times.items()}
        reps.append({"load_1min": load, "median_us": {w: round(v, 1) for w, v in med.items()},
                     "own_us": {w: round(med[w] - med["ready"], 1)
                                for w in ("device_get", "read_in_place")}})
        print(f"load {load:.2f}  " + "  ".join(f"{w} {v:.1f} us" for w, v in med.items()))
    res = {
        "what": "a SamplerOutput of --rows rows fetched to the host on one CPU device, median "
                "µs per call (making the output included), the ways interleaved call by call; "
                "own_us = median - ready's median",
        "command": "python bench/result_fetch.py " + " ".join(sys.argv[1:]),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "rows": b, "k": k, "calls": args.calls,
        "reps": reps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))
    print("wrote", out, "and", out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Each way's own µs per call (above waiting for the arrays), per rep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = len(res["reps"])
    for i, way in enumerate(("device_get", "read_in_place")):
        ax.bar([j + (i - 0.5) * 0.4 for j in range(n)], [r["own_us"][way] for r in res["reps"]],
               0.4, label=way)
    ax.set_xticks(list(range(n)), [f"rep {j + 1} (load {r['load_1min']:.2f})"
                                   for j, r in enumerate(res["reps"])])
    ax.set_ylabel("µs per call above waiting (median)")
    ax.set_title(f"A {res['rows']}-row sampler output to the host (one CPU device)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
