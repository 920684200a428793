"""Separate vs fused layer projections on XLA:CPU (why the unrolled layout fuses them).

    .venv/bin/python bench/fused_projections.py [--iters 15]

30 layers of the demo model's projection matmuls (hidden 576; q 576, k and v 192 columns;
gate and up 1536 each), fp32, per-layer weights as the unrolled loop holds them: q, k, v and
gate, up as separate dots, against one `qkv_proj` and one `gate_up_proj` dot per layer (what
`models.decoder.unstack_layers` builds). Each layer feeds the next, so XLA cannot batch layers.
Runs interleaved (A, B, A, B); medians at 1, 64 and 256 rows. Writes
bench/results/cpu/fused_projections.json with the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, Q, KV, INTER, LAYERS = 576, 576, 192, 1536, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/fused_projections.json"))
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    load = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    w = lambda n: [jnp.asarray(rng.standard_normal((HIDDEN, n)) * 0.02, jnp.float32)  # noqa: E731
                   for _ in range(LAYERS)]
    wq, wk, wv, wg, wu = w(Q), w(KV), w(KV), w(INTER), w(INTER)
    wqkv = [jnp.concatenate(p, 1) for p in zip(wq, wk, wv)]
    wgu = [jnp.concatenate(p, 1) for p in zip(wg, wu)]

    def mix(h, q, k, v, g, u):  # a cheap use of every output, feeding the next layer
        return jnp.tanh(h + (q.sum(-1, keepdims=True) + k.sum(-1, keepdims=True)
                             + v.sum(-1, keepdims=True)
                             + (jax.nn.silu(g) * u).sum(-1, keepdims=True)))

    @jax.jit
    def separate(x, wq, wk, wv, wg, wu):
        for i in range(LAYERS):
            x = mix(x, x @ wq[i], x @ wk[i], x @ wv[i], x @ wg[i], x @ wu[i])
        return x

    @jax.jit
    def fused(x, wqkv, wgu):
        for i in range(LAYERS):
            qkv, gu = x @ wqkv[i], x @ wgu[i]
            x = mix(x, qkv[:, :Q], qkv[:, Q : Q + KV], qkv[:, Q + KV :], gu[:, :INTER],
                    gu[:, INTER:])
        return x

    rows = []
    for m in (1, 64, 256):
        x = jnp.asarray(rng.standard_normal((m, HIDDEN)), jnp.float32)
        calls = {"separate_ms": lambda x=x: separate(x, wq, wk, wv, wg, wu),
                 "fused_ms": lambda x=x: fused(x, wqkv, wgu)}
        outs = {k: np.asarray(jax.block_until_ready(f())) for k, f in calls.items()}
        times = {k: [] for k in calls}
        for _ in range(args.iters):
            for k, f in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                times[k].append(time.perf_counter() - t0)
        row = {"rows": m, **{k: 1e3 * float(np.median(t)) for k, t in times.items()},
               "max_abs_diff": float(np.abs(outs["separate_ms"] - outs["fused_ms"]).max())}
        row["fused_over_separate"] = row["fused_ms"] / row["separate_ms"]
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"what": "ms for 30 layers of projection matmuls (median, interleaved)",
               "command": "python bench/fused_projections.py " + " ".join(sys.argv[1:]),
               "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(),
               "jax": jax.__version__, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
