"""pagedjax as one engine of the side-by-side CPU benchmark (same line protocol as the peers).

    .venv/bin/python bench/peers/pagedjax_worker.py --model smollm2 --threads 2 [--engine-arg k=v ...]

The engine loads once; each line on stdin is a JSON job, each job gets one JSON line on stdout:

    job:    {"prompt_ids": [[...], ...], "max_tokens": 128, "ignore_eos": true}
    result: {"seconds": wall time of LLM.generate for the whole batch,
             "ttft_s": wall time of a max_tokens=1 generate on the prompt (one prompt, else null),
             "outputs": [[token ids], ...], "versions": {...}, "threads": N, "engine_args": {...}}

fp32 and the public API's defaults (prefix caching and chunked prefill on, as vLLM's), except
the KV cache (`cpu_kv_cache_gb`, default 1 GiB here as vLLM's worker gets) and `max_model_len`
(1024, as vLLM's worker): `--engine-arg` overrides any `EngineConfig` field. As the vLLM worker,
the prefix cache is reset before every generate call unless a job says
"reset_prefix_cache": false. `--threads N` pins the process to the first N CPUs it may use
(XLA:CPU sizes its thread pool from the CPUs it can run on), as vLLM's worker binds its
OpenMP threads and the HF worker calls `torch.set_num_threads`.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from pathlib import Path

from protocol import claim_stdout, run_arrivals, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    out = claim_stdout()
    allowed = sorted(os.sched_getaffinity(0))
    if args.threads > len(allowed):
        sys.exit(f"--threads {args.threads} but only CPUs {allowed} are available")
    os.sched_setaffinity(0, allowed[: args.threads])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax

    from pagedjax import LLM, SamplingParams

    engine_args = {"max_model_len": 1024, "cpu_kv_cache_gb": 1.0}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        try:
            engine_args[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            engine_args[k] = v
    llm = LLM(args.model, dtype="float32", **engine_args)
    import jaxlib

    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}

    def generate(prompts, max_tokens: int, ignore_eos: bool, job=None):
        if (job or {}).get("reset_prefix_cache", True):  # as the vLLM worker: no stale hits
            llm.reset_prefix_cache()
        sp = SamplingParams(**{"temperature": 0.0, **((job or {}).get("sampling") or {})},
                            max_tokens=max_tokens, ignore_eos=ignore_eos)
        if job and job.get("arrivals") is not None:  # Poisson serving run, as the peers
            eng = llm.engine

            def add(i):
                eng.add_request(str(i), None, sp, prompt_token_ids=list(map(int, prompts[i])))

            compiles, steps = eng.get_stats().num_compiles, eng.num_steps
            seconds, outputs, extra = run_arrivals(job["arrivals"], add, eng.step,
                                                   eng.has_unfinished_requests)
            # XLA compilations during the run (a compile stalls every request) and steps.
            extra["compiles_during_run"] = eng.get_stats().num_compiles - compiles
            extra["engine_steps"] = eng.num_steps - steps
            return seconds, outputs, extra
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sp,
                           use_tqdm=False)
        return time.perf_counter() - t0, [list(r.outputs[0].token_ids) for r in res]

    generate([[1, 2, 3, 4]], 4, True)
    print(f"pagedjax_worker ready: threads={args.threads} {engine_args} {versions}", file=sys.stderr)
    serve(out, generate, {"versions": versions, "threads": args.threads, "engine_args": engine_args,
                          "layer_loop": "scan" if llm.engine.runner.scan_layers else "unrolled",
                          "prefix_caching": llm.engine.engine_config.enable_prefix_caching,
                          "chunked_prefill": llm.engine.engine_config.enable_chunked_prefill})

if __name__ == "__main__":
    main()
