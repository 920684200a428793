"""The JSON-lines protocol every engine worker of the side-by-side benchmark speaks.

Standalone (standard library only, no repo imports), so the peers' own venvs can use it: the
workers run as scripts from this folder, which puts it on `sys.path`.

    job:    {"prompt_ids": [[...], ...], "max_tokens": 128, "ignore_eos": true, ...}
    result: {"seconds": wall time of the whole batch,
             "ttft_s": wall time of a max_tokens=1 run of the prompt (one prompt, else null),
             "outputs": [[token ids], ...], **the worker's metadata}

A job may add "sampling": {"temperature": ..., "top_p": ..., "top_k": ..., "min_p": ..., and
the "presence_penalty" / "frequency_penalty" / "repetition_penalty"}: the worker samples with
exactly those parameters (unseeded) instead of decoding greedily.

A serving job adds "arrivals": [seconds after the start, one per prompt] (Poisson): the worker
adds each request when its time comes and steps its engine between arrivals
(`run_arrivals`); the result adds "latency_s" and "first_token_s" per request, from arrival.

A job that fails gets {"error": "..."} and the worker goes on; EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import TextIO

# (prompts, max_tokens, ignore_eos, job) -> (seconds, outputs)
Generate = Callable[[list[list[int]], int, bool, dict], tuple[float, list[list[int]]]]


def claim_stdout() -> TextIO:
    """Keep stdout for result lines only: fd 1 becomes stderr for everything else (engine
    logs, child processes that inherit it); returns the stream results go to."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(out: TextIO, generate: Generate, meta: dict) -> None:
    """Answer jobs from stdin until EOF."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            prompts = job["prompt_ids"]
            max_tokens = int(job.get("max_tokens", 128))
            ignore_eos = bool(job.get("ignore_eos", True))
            if job.get("arrivals") is not None:  # a serving run: no separate TTFT probe
                ttft = None
            else:
                ttft = generate(prompts, 1, ignore_eos, job)[0] if len(prompts) == 1 else None
            seconds, outputs, *extra = generate(prompts, max_tokens, ignore_eos, job)
            result = {"seconds": seconds, "ttft_s": ttft, "outputs": outputs, **meta,
                      **(extra[0] if extra else {})}
        except Exception as e:  # noqa: BLE001 - report and keep serving
            traceback.print_exc(file=sys.stderr)
            result = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(result) + "\n")


def run_arrivals(arrivals: list[float], add: Callable[[int], None], step: Callable[[], list],
                 has_work: Callable[[], bool]) -> tuple[float, list[list[int]], dict]:
    """Drive an engine through timed arrivals: `add(i)` queues request i under the id str(i),
    `step()` runs one iteration and returns its request outputs (vLLM's shape, which pagedjax
    shares: `request_id`, `outputs[0].token_ids`, `finished`). Returns the makespan, each
    request's tokens, and per request the seconds from its arrival to its first token and to
    its end. The same loop for every engine, so the peers are driven alike."""
    import time

    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    k = 0
    while len(done) < len(arrivals):
        now = time.perf_counter() - t0
        while k < len(order) and arrivals[order[k]] <= now:
            add(order[k])
            k += 1
        if not has_work():
            if k == len(order):
                raise RuntimeError(f"the engine is idle with {len(arrivals) - len(done)} "
                                   f"requests unfinished")
            time.sleep(max(0.0, arrivals[order[k]] - (time.perf_counter() - t0)))
            continue
        for o in step():
            t = time.perf_counter() - t0
            i = int(o.request_id)
            tokens[i] = list(o.outputs[0].token_ids)
            if tokens[i] and i not in first:
                first[i] = t - arrivals[i]
            if o.finished:
                done[i] = t - arrivals[i]
    n = range(len(arrivals))
    return time.perf_counter() - t0, [tokens[i] for i in n], {
        "first_token_s": [first[i] for i in n], "latency_s": [done[i] for i in n]}


TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib64/libtcmalloc_minimal.so.4")


def tcmalloc_path() -> str | None:
    """The system's tcmalloc (gperftools' minimal build), if installed: what vLLM's CPU guide
    preloads (`vllm_worker.py`), and `offline_throughput.py`'s `pagedjax-tcmalloc` engine."""
    return next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)
