"""Where the main thread's CPU time goes in a real CPU engine step (JAX calls included).

    .venv/bin/python bench/host_breakdown.py --prompts 64
    .venv/bin/python bench/host_breakdown.py --prompts 64 --penalties \
        --engine-arg device_penalty_histories=false   # penalty histories packed on the host

`bench/host_overhead.py` stubs the device calls; this script runs `LLM.generate` on the demo
model (fp32, greedy, the side-by-side benchmark's prompts, 128 tokens) after one untimed
pass, wrapping the engine's stages and its JAX calls with `time.thread_time`, which counts
the main thread's CPU time only (not its waits, unless the wait spins). Reports ms of CPU per
engine step by stage (nested stages indented; a stage's time includes the stages inside
it). On a 2-core CPU every such millisecond competes with the step's kernels
(`bench/host_critical_path.py`). Writes bench/results/cpu/host_breakdown_<prompts>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="the engine's max_model_len: on CPU every step's block tables are "
                         "max_model_len / block_size wide")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for the engine, e.g. device_block_tables=false")
    ap.add_argument("--penalties", action="store_true",
                    help="every request sampled (temperature 0.8, top-p 0.9, seeded) with "
                         "presence and repetition penalties, instead of greedy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    from offline_throughput import make_prompt_ids

    import pagedjax.engine as engine_mod
    from pagedjax import LLM, SamplingParams

    load0 = os.getloadavg()[0]
    import ast

    extra = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        low = v.lower()
        extra[k] = (low == "true" if low in ("true", "false")
                    else ast.literal_eval(v) if v[:1].isdigit() else v)
    llm = LLM("smollm2", dtype="float32", max_model_len=args.max_model_len,
              cpu_kv_cache_gb=1.0, **extra)
    eng, runner = llm.engine, llm.engine.runner
    reqs = [{"prompt_token_ids": p} for p in make_prompt_ids(eng.tokenizer, args.prompts)]
    if args.penalties:
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8, top_p=0.9,
                            seed=0, presence_penalty=0.2, repetition_penalty=1.1)
    else:
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    llm.generate(reqs, sp, use_tqdm=False)  # compiles this workload's shapes

    cpu = collections.defaultdict(float)

    def wrap(obj, name: str, label: str) -> None:
        real = getattr(obj, name)

        def timed(*a, **k):
            t = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                cpu[label] += time.thread_time() - t

        setattr(obj, name, timed)

    stages = [  # (object, attribute, label); indentation: inside the stage above
        (eng, "step", "engine.step"),
        (eng.scheduler, "schedule", "  scheduler.schedule"),
        (eng, "_launch", "  engine._launch"),
        (engine_mod, "build_step_inputs", "    build_step_inputs"),
        (runner, "_execute_local", "    runner._execute_local (the step's dispatch)"),
        (runner, "_step_args", "      runner._step_args (the step's arguments)"),
        (engine_mod, "sample_greedy_hidden", "    sample_greedy_hidden (dispatch)"),
        (runner, "sampled_tokens", "    runner.sampled_tokens (padding jit)"),
        (eng, "_sampling_metadata", "    engine._sampling_metadata"),
        (eng, "_device_histories", "    engine._device_histories"),
        (runner, "gather_histories", "      runner.gather_histories (dispatch)"),
        (eng, "_feed_pending_history", "    engine._feed_pending_history"),
        (engine_mod, "sample", "    sample (dispatch)"),
        (eng, "_finish", "  engine._finish"),
        (engine_mod.jax, "device_get", "    jax.device_get (results)"),
        (eng, "_apply_samples", "    engine._apply_samples"),
    ]
    for obj, name, label in stages:
        wrap(obj, name, label)
    steps0 = eng.num_steps
    llm.reset_prefix_cache()  # the compile run's prompts: computed again, not hit
    t = time.perf_counter()
    llm.generate(reqs, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = eng.num_steps - steps0
    ms = {label: cpu[label] / steps * 1e3 for _, _, label in stages}
    res = {
        "what": "main-thread CPU ms per engine step by stage (time.thread_time), "
                "bench/host_breakdown.py",
        "command": "python bench/host_breakdown.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load0},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "workload": {"prompts": args.prompts, "tokens": args.tokens,
                     "sampling": "penalised" if args.penalties else "greedy",
                     "max_model_len": args.max_model_len, "engine_args": extra},
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "cpu_ms_per_step": ms,
    }
    out = Path(args.out or ROOT / f"bench/results/cpu/host_breakdown_{args.prompts}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for label, v in ms.items():
        print(f"{label:52s} {v:7.3f} ms")
    print(f"{'wall per step':52s} {res['wall_ms_per_step']:7.3f} ms")


if __name__ == "__main__":
    main()
