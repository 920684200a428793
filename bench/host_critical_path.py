"""How much of the host's time per step the whole CPU engine waits for.

    .venv/bin/python bench/host_critical_path.py --prompts 1 --tokens 128 --spin-ms 1 --rounds 6

`bench/host_overhead.py` measures the host's work per step with the device calls stubbed; on a
2-core CPU the "device" is the same two cores, so host work and the step's kernels compete
instead of overlapping. This script runs `LLM.generate` on the demo model (fp32, greedy, the
side-by-side benchmark's prompts) with and without ``--spin-ms`` of extra busy host work
after every `LLMEngine.step`, rounds interleaved (A, B, B, A, ...), each after an untimed
8-token settle, and reports ms per decode step: the difference over the spin is the share of
host time on the critical path (1: every host microsecond delays the step; 0: all hidden).
Writes bench/results/cpu/host_critical_path.json (``--out``).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--spin-ms", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/host_critical_path.json"))
    args = ap.parse_args()

    import jax
    from offline_throughput import make_prompt_ids

    from pagedjax import LLM, SamplingParams

    load0 = os.getloadavg()[0]
    llm = LLM("smollm2", dtype="float32", max_model_len=1024, cpu_kv_cache_gb=1.0)
    eng = llm.engine
    reqs = [{"prompt_token_ids": p} for p in make_prompt_ids(eng.tokenizer, args.prompts)]
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    settle = SamplingParams(max_tokens=8, temperature=0)
    real_step, spin = eng.step, {"s": 0.0}

    def step():
        out = real_step()
        t = time.perf_counter()
        while time.perf_counter() - t < spin["s"]:
            pass
        return out

    eng.step = step
    llm.generate(reqs, sp, use_tqdm=False)  # compiles this workload's shapes
    ms = {"plain": [], "spin": []}
    for r in range(args.rounds):
        for mode in (("plain", "spin") if r % 2 == 0 else ("spin", "plain")):
            spin["s"] = args.spin_ms / 1e3 if mode == "spin" else 0.0
            llm.generate(reqs[:1], settle, use_tqdm=False)
            llm.reset_prefix_cache()  # every round computes its prompts (no hits)
            t = time.perf_counter()
            llm.generate(reqs, sp, use_tqdm=False)
            ms[mode].append((time.perf_counter() - t) / args.tokens * 1e3)
    plain, spun = statistics.median(ms["plain"]), statistics.median(ms["spin"])
    res = {
        "what": "ms per generated token (one decode step per token) with and without extra "
                "busy host work after every engine step (bench/host_critical_path.py)",
        "command": "python bench/host_critical_path.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load0},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "workload": {"prompts": args.prompts, "tokens": args.tokens},
        "spin_ms": args.spin_ms,
        "ms_per_step_median": {"plain": plain, "spin": spun},
        "ms_per_step_all": ms,
        "critical_share": (spun - plain) / args.spin_ms,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("ms_per_step_median", "critical_share")}))


if __name__ == "__main__":
    main()
