"""CPU paged attention, one layer: the native kernel against the two XLA formulations.

    .venv/bin/python bench/cpu_attention.py [--iters 20]

- `native`: `pallas_kernels/cpu_native.py` (the CPU default), reading blocks in place; it
  gets the engine's full-width table (64 blocks = `max_model_len` 1024).
- `xla_per_token`: one decode query per token, gathering each token's table (what the XLA
  path runs for steps of at most 2^16 token x slots);
- `xla_items`: work items of 32 query rows (the XLA path for larger steps).
The XLA formulations get the narrowest table width the XLA path's shape plan allows for the
case (16 or 64 blocks). Shapes of the demo model (9 query / 3 KV heads, head dim 64), 16
slots per block, fp32, random block tables over a 4096-block cache. Mixed cases are decodes
at 80-token contexts beside one prompt; decode cases give every sequence the same context.
The formulations run interleaved (A, B, C, A, B, C, ...) and the median per formulation is
reported, with the load average at the start and the largest difference from the native
output. Writes bench/results/cpu/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (kind, tokens, sequences, prompt tokens or context length, XLA width in blocks)
CASES = [
    ("mixed", 64, 64, 1, 16),
    ("mixed", 64, 48, 14, 16),
    ("mixed", 128, 64, 60, 16),
    ("decode", 1, 1, 1000, 64),
    ("decode", 64, 64, 128, 16),
    ("decode", 64, 64, 1000, 64),
    ("decode", 256, 256, 200, 16),
]
WIDTH = 64  # the engine's table width at max_model_len 1024 (fixed with the native kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/cpu_attention.json"))
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from pallas_kernels import cpu_native
    from pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention_per_token,
        ragged_paged_attention_ref,
    )

    if not cpu_native.available():
        sys.exit("the native CPU kernel did not build")
    load = os.getloadavg()[0]
    heads, kv_heads, dim, blocks, bs = 9, 3, 64, 4096, 16
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, kv_heads, blocks, bs, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, kv_heads, blocks, bs, dim)), jnp.float32)
    fns = {
        "native_ms": functools.partial(cpu_native.ragged_paged_attention_cpu, scale=0.125),
        "xla_per_token_ms": functools.partial(ragged_paged_attention_per_token, scale=0.125),
        "xla_items_ms": functools.partial(ragged_paged_attention_ref, scale=0.125, block_q=32),
    }
    rows = []
    for kind, tokens, seqs, n, xla_width in CASES:
        if kind == "mixed":
            q_lens, kv_lens = [1] * (seqs - 1) + [n], [80] * (seqs - 1) + [n]
        else:
            q_lens, kv_lens = [1] * seqs, [n] * seqs
        cu = np.zeros(seqs + 1, np.int32)
        cu[1:] = np.cumsum(q_lens)
        table = rng.integers(0, blocks, (seqs, WIDTH)).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((tokens, heads, dim)), jnp.float32)
        common = (jnp.asarray(kv_lens, jnp.int32),)
        tail = (jnp.asarray(cu), jnp.int32(seqs), jnp.int32(0))
        calls = {name: (jax.jit(fn), (q, k, v, *common,
                                      jnp.asarray(table[:, : WIDTH if name == "native_ms"
                                                        else xla_width]), *tail))
                 for name, fn in fns.items()}
        if kind == "decode" and tokens * xla_width * bs > (1 << 16):
            del calls["xla_per_token_ms"]  # the XLA path would not pick it at this size
        outs = {name: jax.block_until_ready(f(*a)) for name, (f, a) in calls.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.iters):
            for name, (f, a) in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*a))
                times[name].append(time.perf_counter() - t0)
        row = {"kind": kind, "tokens": tokens, "sequences": seqs,
               ("prompt_tokens" if kind == "mixed" else "context"): n,
               "xla_width_blocks": xla_width, "native_width_blocks": WIDTH}
        row.update({name: 1e3 * float(np.median(t)) for name, t in times.items()})
        row["max_abs_diff_vs_native"] = max(
            float(jnp.abs(o - outs["native_ms"]).max()) for o in outs.values())
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"what": "ms per layer (median, interleaved): native CPU kernel vs XLA formulations",
               "command": "python bench/cpu_attention.py " + " ".join(sys.argv[1:]),
               "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(),
               "cpu": platform.processor() or platform.machine(),
               "jax": jax.__version__, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
