"""How many top-p candidates the sampler reads (`pagedjax.sampler.TOP_CANDIDATES`), on real
logits of the demo model.

    .venv/bin/python bench/sampler_candidates.py [--candidates 64,128,256] [--reps 3]

`sample` reads top-k / top-p thresholds from the largest `TOP_CANDIDATES` logits and draws
among them when every row's nucleus lies within them; if one row's does not, the whole batch
takes the exact search and the noise over the whole vocabulary (`pagedjax/sampler.py`). This
script runs the demo engine (fp32) on the side-by-side benchmark's 64 prompts with
temperature 0.8 / top-p 0.9 and temperature 1.0 / top-p 0.95, 48 tokens each, and keeps the
logits and sampling metadata `sample` got at 6 decode steps spread over each run. Then, for
each candidate count, a fresh process (counts alternating, `--reps` rounds) times `sample` on
every kept step (median of 7 calls after 3 untimed) and counts the steps whose nucleus fits.
Tokens are the same whatever the count (the draw among candidates equals the whole draw;
`tests/sampling`), which the script checks. It also counts, per kept step, the rows GPUs'
two-stage candidates (`pagedjax/chunked_top_k.py`) decide against the one-stage ones
(`chunked_top_k` in the JSON). Writes bench/results/cpu/sampler_candidates.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SETTINGS = [(0.8, 0.9), (1.0, 0.95)]
KEEP_STEPS = 6


def capture(path: Path) -> None:
    import jax
    import numpy as np
    from offline_throughput import make_prompt_ids

    import pagedjax.engine as engine_mod
    from pagedjax import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", max_model_len=1024, cpu_kv_cache_gb=1.0)
    reqs = [{"prompt_token_ids": p} for p in make_prompt_ids(llm.engine.tokenizer, 64)]
    real = engine_mod.sample
    kept = []
    for temperature, top_p in SETTINGS:
        calls = []

        def spy(logits, meta, num_logprobs=0, rows=None, calls=calls, **kw):
            if logits.shape[0] == 64:  # decode steps of the whole batch
                calls.append((np.asarray(logits), jax.tree.map(np.asarray, meta),
                              None if rows is None else np.asarray(rows)))
            return real(logits, meta, num_logprobs=num_logprobs, rows=rows, **kw)

        engine_mod.sample = spy
        try:
            llm.generate(reqs, SamplingParams(max_tokens=48, ignore_eos=True, seed=0,
                                              temperature=temperature, top_p=top_p),
                         use_tqdm=False)
        finally:
            engine_mod.sample = real
        picks = np.linspace(0, len(calls) - 1, KEEP_STEPS).round().astype(int)
        kept += [((temperature, top_p), *calls[i]) for i in picks]
    path.write_bytes(pickle.dumps(kept))


def nucleus_sizes(logits, temperature: float, top_p: float) -> list[int]:
    import numpy as np

    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    c = np.cumsum(-np.sort(-p, 1), 1)
    return ((c < top_p).sum(1) + 1).tolist()


def chunked_rows(logits, temperature: float, top_p: float, chunk: int) -> dict:
    """Of a step's rows: how many nuclei the one-stage candidates hold (<= TOP_CANDIDATES),
    how many the chunked ones decide (GPUs' `chunked_top_k`: the nucleus also within the
    values above the largest 16th value of a chunk), and how many rows' top-20 logprobs
    come from the chunked stage without the whole-row fallback (`exact_top_k`); for the
    strided chunks `chunked_top_k` uses and, for comparison, contiguous ones."""
    import numpy as np

    from pagedjax.chunked_top_k import PER_CHUNK
    from pagedjax.sampler import TOP_CANDIDATES

    b, v = logits.shape
    c = -(-v // chunk)
    x = np.pad(logits.astype(np.float64), ((0, 0), (0, c * chunk - v)), constant_values=-np.inf)
    n = np.array(nucleus_sizes(logits, temperature, top_p))
    out = {"rows": b, "one_stage_decides": int((n <= TOP_CANDIDATES).sum())}
    for layout, xc in (("strided", x.reshape(b, chunk, c).transpose(0, 2, 1)),
                       ("contiguous", x.reshape(b, c, chunk))):
        hidden = np.sort(xc, axis=-1)[:, :, -PER_CHUNK].max(axis=-1)
        exact = (logits > hidden[:, None]).sum(axis=1)
        out[layout] = {"chunked_decides": int((n <= np.minimum(TOP_CANDIDATES, exact)).sum()),
                       "top20_exact": int((exact >= 20).sum()),
                       "min_exact_prefix": int(exact.min())}
    return out


def time_candidates(path: Path, candidates: int) -> dict:
    import jax
    import numpy as np

    import pagedjax.sampler as sampler_mod

    sampler_mod.TOP_CANDIDATES = candidates  # read when `sample` is traced: this process only
    kept = pickle.loads(path.read_bytes())
    out = []
    for setting, logits, meta, rows in kept:
        def call(logits=logits, meta=meta, rows=rows):
            return jax.block_until_ready(sampler_mod.sample(logits, meta, num_logprobs=20,
                                                            rows=rows))
        for _ in range(3):
            res = call()
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
        out.append({"setting": setting, "ms": 1e3 * statistics.median(ts),
                    "tokens": np.asarray(res.token_ids).tolist(),
                    "largest_nucleus": max(nucleus_sizes(logits, *setting))})
    return {"candidates": candidates, "steps": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", default="64,128,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/pagedjax_sampler_candidates.pkl")
    ap.add_argument("--time", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/sampler_candidates.json"))
    args = ap.parse_args()
    work = Path(args.work)
    if args.time:
        print(json.dumps(time_candidates(work, args.time)))
        return
    load = os.getloadavg()[0]
    capture(work)
    counts = [int(c) for c in args.candidates.split(",")]
    runs = []
    for rep in range(args.reps):
        order = counts if rep % 2 == 0 else counts[::-1]
        for c in order:
            res = subprocess.run([sys.executable, __file__, "--time", str(c), "--work", str(work)],
                                 check=True, capture_output=True, text=True)
            r = {**json.loads(res.stdout.strip().splitlines()[-1]), "rep": rep}
            runs.append(r)
            total = sum(s["ms"] for s in r["steps"])
            print(f"rep {rep} candidates {c:4d}: {total:7.1f} ms over {len(r['steps'])} steps",
                  flush=True)
    first = runs[0]["steps"]
    from pagedjax.chunked_top_k import TOPK_CHUNK

    chunk_stats = [chunked_rows(logits, *setting, TOPK_CHUNK)
                   for setting, logits, _, _ in pickle.loads(work.read_bytes())]
    print("chunked top-k on these logits (per step):", chunk_stats)
    same = all(s["tokens"] == f["tokens"] for r in runs for s, f in zip(r["steps"], first,
                                                                         strict=True))
    summary = {}
    for c in counts:
        mine = [r for r in runs if r["candidates"] == c]
        per_step = [statistics.median(r["steps"][i]["ms"] for r in mine)
                    for i in range(len(first))]
        summary[c] = {"median_ms_per_step": per_step, "total_ms": sum(per_step),
                      "steps_within_candidates": sum(s["largest_nucleus"] <= c for s in first)}
        print(f"candidates {c}: {sum(per_step):.1f} ms over {len(per_step)} steps, "
              f"{summary[c]['steps_within_candidates']} steps' nuclei within")
    import jax

    out = {"what": "`sample` ms per 64-row decode step of the demo model (real logits: "
                   f"temperature/top-p {SETTINGS}, {KEEP_STEPS} steps each), by TOP_CANDIDATES "
                   "(bench/sampler_candidates.py)",
           "command": "python bench/sampler_candidates.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "versions": {"jax": jax.__version__, "python": platform.python_version()},
           "largest_nucleus_per_step": [s["largest_nucleus"] for s in first],
           "settings_per_step": [s["setting"] for s in first],
           "tokens_identical_across_counts": same, "summary": summary,
           "chunked_top_k": {"chunk": TOPK_CHUNK, "per_step": chunk_stats},
           "runs": [{**r, "steps": [{k: v for k, v in st.items() if k != "tokens"}
                                    for st in r["steps"]]} for r in runs]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(first))
        for c in counts:
            ax.plot(xs, summary[c]["median_ms_per_step"], marker="o", label=f"{c} candidates")
        ax.set_xlabel("kept decode step (first 6: T 0.8 / top-p 0.9; last 6: T 1.0 / 0.95)")
        ax.set_ylabel("sample, ms (64 rows)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    if not same:
        raise SystemExit("tokens differ between candidate counts")


if __name__ == "__main__":
    main()
