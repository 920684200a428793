"""Scaled-down traces for the paper figures (built on ``bench/workloads.py``).

Workloads: ``sharegpt`` / ``alpaca`` (Fig. 12-15, 18-19), ``translation-1shot`` /
``translation-5shot`` (Fig. 16: every prompt starts with the same few-shot prefix) and
``chatbot`` (Fig. 17: history cut to the last 1024*scale tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.workloads import (
    TRANSLATION_PREFIX,
    WORKLOADS,
    chatbot_lengths,
    poisson_arrivals,
    translation_lengths,
)

TRACE_WORKLOADS = (*WORKLOADS, *TRANSLATION_PREFIX, "chatbot")


@dataclass(frozen=True)
class TraceReq:
    index: int
    prompt_len: int  # prefix included
    output_len: int  # forced with ignore_eos; the oracle's "true output length"
    arrival: float  # seconds from the start
    prefix_len: int = 0  # leading prompt tokens identical across requests (translation prefix)


def _lengths(workload: str, rng: np.random.Generator, n: int, scale: float):
    if workload in WORKLOADS:
        w = WORKLOADS[workload]
        return 0, w.input.sample(rng, n, scale), w.output.sample(rng, n, scale)
    if workload in TRANSLATION_PREFIX:
        return translation_lengths(rng, n, workload, scale)
    if workload == "chatbot":
        return (0, *chatbot_lengths(rng, n, scale))
    raise ValueError(f"unknown workload {workload!r}; expected one of {TRACE_WORKLOADS}")


def make_trace(workload: str, n: int, rate: float, *, scale: float, max_model_len: int,
               seed: int = 0) -> list[TraceReq]:
    """Same lengths for every rate (seeded separately from arrivals), so rates are comparable."""
    prefix, ins, outs = _lengths(workload, np.random.default_rng(seed), n, scale)
    arrivals = poisson_arrivals(np.random.default_rng(seed + 1), n, rate)
    cap = max_model_len // 2  # the chatbot's 1024*scale cut is exactly this at 2048*scale context
    reqs = []
    for i in range(n):
        inp = int(min(ins[i], cap))
        out = int(max(1, min(outs[i], max_model_len - 1 - inp)))
        reqs.append(TraceReq(i, inp, out, float(arrivals[i]), min(prefix, inp)))
    return reqs


def prompt_ids(req: TraceReq, vocab_size: int, seed: int = 0) -> list[int]:
    """Random non-special token ids; the first ``prefix_len`` are the same for every request."""
    shared = np.random.default_rng((seed, 1 << 30)).integers(100, vocab_size, size=req.prefix_len)
    own = np.random.default_rng((seed, req.index)).integers(100, vocab_size,
                                                           size=req.prompt_len - req.prefix_len)
    return [*shared.tolist(), *own.tolist()]
