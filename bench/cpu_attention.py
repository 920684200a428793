"""Mixed-step attention on the XLA (CPU) path: work items of 32 query rows vs one decode query
per token (the formulation `ragged_paged_attention` picks for small steps).

    .venv/bin/python bench/cpu_attention.py [--iters 20]

Shapes of the demo model (9 query / 3 KV heads, head dim 64), 16 slots per block, a 16-block
table (256 slots) per sequence, fp32, one layer; decodes have 80-token contexts. Random block
tables over a 2048-block cache. Writes bench/results/cpu/cpu_attention.json with the load
average at the start and the maximum difference between the two formulations.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [(64, 64, 1), (64, 48, 14), (128, 64, 60)]  # (tokens, sequences, prompt tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/cpu_attention.json"))
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention_per_token,
        ragged_paged_attention_ref,
    )

    load = os.getloadavg()[0]
    heads, kv_heads, dim, blocks, bs, width = 9, 3, 64, 2048, 16, 16
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((1, kv_heads, blocks, bs, dim)), jnp.float32)
    rows = []
    for tokens, seqs, prompt in CASES:
        q_lens = [1] * (seqs - 1) + [prompt]
        cu = np.zeros(seqs + 1, np.int32)
        cu[1:] = np.cumsum(q_lens)
        args_ = (jnp.asarray(rng.standard_normal((tokens, heads, dim)), jnp.float32), cache, cache,
                 jnp.asarray([80] * (seqs - 1) + [prompt], jnp.int32),
                 jnp.asarray(rng.integers(0, blocks, (seqs, width)), jnp.int32),
                 jnp.asarray(cu), jnp.int32(seqs), jnp.int32(0))
        outs, row = {}, {"tokens": tokens, "sequences": seqs, "prompt_tokens": prompt}
        for name, fn in (("items_32_rows_ms", functools.partial(ragged_paged_attention_ref,
                                                                 scale=0.125, block_q=32)),
                         ("per_token_ms", functools.partial(ragged_paged_attention_per_token,
                                                            scale=0.125))):
            f = jax.jit(fn)
            outs[name] = jax.block_until_ready(f(*args_))
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args_))
                times.append(time.perf_counter() - t0)
            row[name] = 1e3 * float(np.median(times))
        row["max_abs_diff"] = float(jnp.abs(outs["items_32_rows_ms"] - outs["per_token_ms"]).max())
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"what": "ms per layer (median), XLA ragged attention: items vs per token",
               "command": "python bench/cpu_attention.py " + " ".join(sys.argv[1:]),
               "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(),
               "jax": jax.__version__, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
