"""Variants of the pagedjax engine in one process, interleaved (A, B, C, A, B, C, ...).

    .venv/bin/python bench/inprocess_ab.py --workload 64x128 --reps 5 \
        --variant base:PAGEDJAX_ROPE_ONCE=0,PAGEDJAX_FUSED_NORM=0 \
        --variant rope:PAGEDJAX_FUSED_NORM=0 --variant rope+norm: \
        --out bench/results/cpu/inprocess_ab_rope_norm_64x128_zen4_stop83.json

Why beside `offline_throughput.py --engines A,B`: on the 2-core VMs this project measures on,
two worker processes of the same code differ by up to ~8 % for reasons of their own (where
their memory landed, which huge pages they got), which hides a change of a few per cent. Here
every variant is an `LLM` in the same process on the same XLA thread pool, loaded from the same
file, and they take turns generation by generation.

A variant is ``NAME:ENV=VALUE[,ENV=VALUE...]``: environment variables set while its engine is
built and warmed up and before each of its runs. So only switches read when an engine builds
or traces its step qualify (`PAGEDJAX_ROPE_ONCE`, `PAGEDJAX_FUSED_NORM`, `PAGEDJAX_LIVE_ROWS`,
`PAGEDJAX_NATIVE_GREEDY`, ...), not those a native kernel reads once per process
(`PAGEDJAX_MATMUL_TAKE_OVER`). The first variant is the baseline of the ratios. Greedy, EOS
ignored, the demo model in fp32 and the prompts of `offline_throughput.py`; each variant's
outputs must equal the baseline's token for token (reported). Refuses to start when the
1-minute load is over --max-load.
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
sys.path.insert(0, str(ROOT / "bench"))


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME:ENV=VALUE[,ENV=VALUE...]")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not ENV=VALUE")
        env[key] = value
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--workload", default="64x128", help="PROMPTSxTOKENS")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) < 2:
        raise SystemExit("give two --variant or more (distinct names)")
    n, toks = (int(v) for v in args.workload.split("x"))
    load0 = os.getloadavg()[0]
    if load0 > args.max_load:
        raise SystemExit(f"load average {load0:.2f} > {args.max_load}: the machine is busy")

    from offline_throughput import cpu_model, make_prompt_ids

    from models.demo import ensure_demo_model
    from models.tokenizer import load_tokenizer
    from pagedjax import LLM, SamplingParams

    gguf = ensure_demo_model()
    prompts = [{"prompt_token_ids": p} for p in make_prompt_ids(load_tokenizer(gguf), n)]
    sp = SamplingParams(temperature=0.0, max_tokens=toks, ignore_eos=True)
    llms, tokens = {}, {}
    for name, env in variants.items():
        os.environ.update(env)
        llms[name] = LLM(str(gguf), dtype="float32", max_model_len=1024, cpu_kv_cache_gb=1.0)
        outs = llms[name].generate(prompts, sp, use_tqdm=False)  # compiles every shape
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        for key in env:
            os.environ.pop(key)
    rates = {name: [] for name in variants}
    loads = []
    for rep in range(args.reps):
        for name, llm in llms.items():
            os.environ.update(variants[name])
            llm.reset_prefix_cache()
            loads.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            rates[name].append(n * toks / (time.perf_counter() - t0))
            for key in variants[name]:
                os.environ.pop(key)
        print(rep, {k: round(v[-1], 1) for k, v in rates.items()}, flush=True)
    base = next(iter(variants))
    summary = {}
    for name, r in rates.items():
        summary[name] = {
            "tokens_per_s_median": statistics.median(r), "tokens_per_s_all": r,
            "over_base_per_rep": [round(a / b, 4) for a, b in zip(r, rates[base])],
            "over_base_of_medians": statistics.median(r) / statistics.median(rates[base]),
            "identical_to_base": f"{sum(a == b for a, b in zip(tokens[name], tokens[base]))}/{n}"}
        print(f"{name:>14}: {summary[name]['tokens_per_s_median']:7.1f} tok/s, "
              f"x{summary[name]['over_base_of_medians']:.3f} ({summary[name]['over_base_per_rep']}),"
              f" identical {summary[name]['identical_to_base']}")
    if args.out:
        import jax

        res = {"what": "pagedjax variants in one process, interleaved (bench/inprocess_ab.py)",
               "command": "python " + " ".join(sys.argv),
               "workload": args.workload, "variants": variants, "summary": summary,
               "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                           "python": platform.python_version(), "jax": jax.__version__,
                           "load_avg_1m_at_start": load0,
                           "load_avg_1m_before_runs": {"min": min(loads), "max": max(loads)}}}
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
