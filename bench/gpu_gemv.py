"""Where a small-batch decode step's time goes: the weight matmuls alone, against a read.

    python3 bench/gpu_gemv.py --out $OUT/gpu_gemv.json          # on a lent GPU (8B shapes)
    .venv/bin/python bench/gpu_gemv.py --model tiny --out F      # harness check on CPU

The sixth H200 run's whole Llama-3-8B decode step read its weights at 2.5-2.8 TB/s, ~55 % of
the HBM's 4.8 TB/s (docs/gpu.md). This splits that step's weight traffic into its matmuls:

- ``read_gbps``: reductions over 2 GiB (`bench/kernels.read_bandwidth`), the ceiling;
- ``dots``: one ``x [rows, in] @ W [in, out]`` per projection the unrolled layers run (fused
  qkv, o, fused gate-up, down) and the LM head, bf16, each alone: ms and GB/s of ``W``;
- ``chain``: every layer's four matmuls and the head in one jit, layers feeding each other
  (per-layer weight arrays as the unrolled loop holds them; an add, a SiLU gate, no norms or
  attention): the weight-only step. If it runs near the read rate, the missing time of the
  real step is in attention, norms, the sampler and gaps; if it is as slow as the step, in
  the matmuls themselves.

Rows 1, 16 and 64 by default. Every figure is a device time per call (`bench.kernels.bench`:
the fastest of four rounds of back-to-back calls, ``--iters`` calls in all, after two
warm-ups; the seventh run's file timed each call with a wait after it), in one process; the
JSON records device, versions and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def projections(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each matmul of an unrolled layer, and the head's."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h), "lm_head": (h, cfg.vocab_size)}


def run(model: str, rows: list[int], iters: int) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.gpu_suite.seeded import SPECS
    from bench.kernels import bench, read_bandwidth

    cfg = SPECS[model].config
    dt = jnp.bfloat16
    on_cpu = jax.devices()[0].platform == "cpu"
    shapes = projections(cfg)
    counter = iter(range(1 << 30))
    key = lambda: jax.random.fold_in(jax.random.key(0), next(counter))  # noqa: E731

    draw = jax.jit(lambda k, shape: jax.random.normal(k, shape, dt) * 0.02, static_argnums=1)

    def weight(shape):  # drawn on the device: 15 GB of 8B weights never cross the host
        return draw(key(), shape)

    layers = [{n: weight(shapes[n]) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
              for _ in range(cfg.num_layers)]
    head = weight(shapes["lm_head"])
    q = cfg.num_heads * cfg.head_dim
    i = cfg.intermediate_size
    dot = jax.jit(lambda x, w: x @ w)

    @jax.jit
    def chain(x, layers, head):
        for w in layers:
            x = x + (x @ w["qkv_proj"])[:, :q] @ w["o_proj"]
            g = x @ w["gate_up_proj"]
            x = x + (jax.nn.silu(g[:, :i]) * g[:, i:]) @ w["down_proj"]
        return x @ head

    nbytes = lambda a: a.size * a.dtype.itemsize  # noqa: E731
    layer_bytes = sum(nbytes(a) for a in layers[0].values())
    chain_bytes = layer_bytes * cfg.num_layers + nbytes(head)
    res: dict = {"read_gbps": read_bandwidth((1 << 22) if on_cpu else (1 << 31), iters),
                 "chain_weight_bytes": chain_bytes, "dots": [], "chain": []}
    for r in rows:
        x = jax.random.normal(key(), (r, cfg.hidden_size), dt)
        for name, (n_in, _) in shapes.items():
            w = head if name == "lm_head" else layers[0][name]
            xi = x if n_in == cfg.hidden_size else jnp.ones((r, n_in), dt)
            t = bench(lambda xi=xi, w=w: dot(xi, w), iters)
            res["dots"].append({"rows": r, "name": name, "shape": list(w.shape),
                                "ms": t * 1e3, "gbps": nbytes(w) / t / 1e9})
        t = bench(lambda x=x: chain(x, layers, head), iters)
        res["chain"].append({"rows": r, "ms": t * 1e3, "gbps": chain_bytes / t / 1e9,
                             "pct_of_read": 100 * chain_bytes / t / 1e9 / res["read_gbps"]})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_8b", help="a bench.gpu_suite.seeded spec")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import jax

    load = os.getloadavg()[0]
    t0 = time.monotonic()
    res = run(args.model, [int(r) for r in args.rows.split(",")], args.iters)
    res.update({"what": __doc__.splitlines()[0], "model": args.model,
                "command": " ".join(["python3 bench/gpu_gemv.py", *(argv or sys.argv[1:])]),
                "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "python": platform.python_version(), "load_avg_1m_at_start": load,
                "iters": args.iters, "elapsed_s": time.monotonic() - t0})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for c in res["chain"]:
        print(f"rows {c['rows']:>4}: weight-only chain {c['ms']:.2f} ms, {c['gbps']:.0f} GB/s "
              f"({c['pct_of_read']:.0f} % of the {res['read_gbps']:.0f} GB/s read)")
    for d in res["dots"]:
        print(f"rows {d['rows']:>4} {d['name']:<13} {d['ms']:.3f} ms {d['gbps']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
