"""Scaled-down ShareGPT-/Alpaca-like traces for the paper figures (built on ``bench/workloads.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.workloads import WORKLOADS, poisson_arrivals


@dataclass(frozen=True)
class TraceReq:
    index: int
    prompt_len: int
    output_len: int  # forced with ignore_eos; the oracle's "true output length"
    arrival: float  # seconds from the start


def make_trace(workload: str, n: int, rate: float, *, scale: float, max_model_len: int,
               seed: int = 0) -> list[TraceReq]:
    """Same lengths for every rate (seeded separately from arrivals), so rates are comparable."""
    w = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    ins = w.input.sample(rng, n, scale)
    outs = w.output.sample(rng, n, scale)
    arrivals = poisson_arrivals(np.random.default_rng(seed + 1), n, rate)
    reqs = []
    for i in range(n):
        inp = int(min(ins[i], max_model_len // 2))
        out = int(max(1, min(outs[i], max_model_len - 1 - inp)))
        reqs.append(TraceReq(i, inp, out, float(arrivals[i])))
    return reqs


def prompt_ids(req: TraceReq, vocab_size: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng((seed, req.index))
    return rng.integers(100, vocab_size, size=req.prompt_len).tolist()
