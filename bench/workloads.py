"""Synthetic request workloads shared by the benchmarks: length distributions and Poisson arrivals.

We cannot ship the ShareGPT / Alpaca datasets, so we sample prompt and output lengths from
log-normal distributions matched to the statistics the vLLM paper reports for them (Kwon et al.,
SOSP'23, §6.1 and Fig. 11):

- Alpaca:   mean input ≈ 19.31 tokens, mean output ≈ 58.45 tokens (short, low variance).
- ShareGPT: mean input ≈ 161.31 tokens, mean output ≈ 337.99 tokens — 8.4x longer prompts and
  5.8x longer outputs than Alpaca on average, with higher variance.

The means are the paper's; the spreads (log-space sigma) are our reading of Fig. 11's histograms
(ShareGPT has long tails to ~1-2k tokens; Alpaca is concentrated below ~100), so treat them as
assumptions, not measurements. Lengths are clipped to [1, max] and to the model's context.
`scale` multiplies both means (same shape, shorter sequences) so CPU smoke runs stay small.

As in the paper's (and vLLM's) serving benchmarks, requests arrive as a Poisson process: the
inter-arrival times are exponential with mean 1/rate. Outputs are forced to the sampled length
(`ignore_eos=True`, `max_tokens=len`) so every system generates the same number of tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Log-normal lengths with a given mean (tokens) and log-space sigma."""

    mean: float
    sigma: float
    max_len: int

    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        mu = math.log(self.mean * scale) - self.sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2/2)
        x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(x), 1, max(1, int(self.max_len * scale))).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    input: LengthDist
    output: LengthDist
    source: str


WORKLOADS = {
    "alpaca": Workload("alpaca", LengthDist(19.31, 0.55, 512), LengthDist(58.45, 0.75, 1024),
                       "vLLM paper Fig. 11 (Alpaca): means 19.31 in / 58.45 out"),
    "sharegpt": Workload("sharegpt", LengthDist(161.31, 1.0, 2048), LengthDist(337.99, 0.9, 2048),
                         "vLLM paper Fig. 11 (ShareGPT): means 161.31 in / 337.99 out"),
}


@dataclasses.dataclass
class Request:
    """One synthetic request: token ids (exact prompt length) and the output length to force."""

    index: int
    prompt_token_ids: list[int]
    output_len: int
    arrival: float  # seconds after the start of the run


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival offsets of a Poisson process of `rate` req/s (rate=inf: all at t=0)."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def make_requests(workload: str, n: int, rate: float, *, vocab_size: int, max_model_len: int,
                  scale: float = 1.0, seed: int = 0, min_token_id: int = 100) -> list[Request]:
    """`n` requests of a workload; prompts are random non-special token ids (`>= min_token_id`)."""
    w = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    ins = w.input.sample(rng, n, scale)
    outs = w.output.sample(rng, n, scale)
    arrivals = poisson_arrivals(rng, n, rate)
    reqs = []
    for i in range(n):
        inp = int(min(ins[i], max_model_len // 2))
        out = int(max(1, min(outs[i], max_model_len - 1 - inp)))
        ids = rng.integers(min_token_id, vocab_size, size=inp).tolist()
        reqs.append(Request(i, ids, out, float(arrivals[i])))
    return reqs


def describe(reqs: list[Request]) -> dict:
    ins = np.array([len(r.prompt_token_ids) for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    return {"num_requests": len(reqs), "mean_input": float(ins.mean()), "mean_output": float(outs.mean()),
            "std_input": float(ins.std()), "std_output": float(outs.std()),
            "duration_s": float(reqs[-1].arrival) if reqs else 0.0}


# --- Paper §6.4–6.5 workloads ----------------------------------------------------------------
# Translation (Fig. 16): WMT16 English->German with a shared few-shot prefix of an instruction
# and examples. The prefix lengths are the paper's (1-shot 80 tokens, 5-shot 341 tokens). The
# sentence lengths are our assumption: a WMT16 news sentence averages ~22 English words, which
# is ~30 LLaMA tokens; the German translation is ~20% longer in tokens. Moderate spread.
TRANSLATION_PREFIX = {"translation-1shot": 80, "translation-5shot": 341}
TRANSLATION_SOURCE = LengthDist(30.0, 0.5, 256)
TRANSLATION_TARGET = LengthDist(36.0, 0.5, 256)
# Chatbot (Fig. 17): the prompt is the conversation so far (earlier rounds' queries and
# answers, then the new query), cut to its last 1024 tokens; at most 1024 tokens generated.
# Rounds use the ShareGPT-like lengths above. Number of earlier rounds: geometric with
# P(0) = 0.2 (mean 4) -- our assumption, chosen so that, as the paper observes for ShareGPT,
# most prompts hit the 1024-token cut.
CHAT_MAX_PROMPT, CHAT_MAX_OUTPUT, CHAT_FIRST_ROUND_P = 1024, 1024, 0.2


def translation_lengths(rng: np.random.Generator, n: int, workload: str,
                        scale: float = 1.0) -> tuple[int, np.ndarray, np.ndarray]:
    """(shared prefix length, prompt lengths including the prefix, output lengths)."""
    prefix = max(1, round(TRANSLATION_PREFIX[workload] * scale))
    src = TRANSLATION_SOURCE.sample(rng, n, scale)
    return prefix, prefix + src, TRANSLATION_TARGET.sample(rng, n, scale)


def chatbot_lengths(rng: np.random.Generator, n: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths after the cut to the last 1024*scale tokens, output lengths <= 1024*scale)."""
    sg = WORKLOADS["sharegpt"]
    rounds = rng.geometric(CHAT_FIRST_ROUND_P, size=n) - 1
    hist = np.array([int(sg.input.sample(rng, k, scale).sum() + sg.output.sample(rng, k, scale).sum())
                     if k else 0 for k in rounds])
    query = sg.input.sample(rng, n, scale)
    prompts = np.minimum(hist + query, max(1, int(CHAT_MAX_PROMPT * scale)))
    outs = np.minimum(sg.output.sample(rng, n, scale), max(1, int(CHAT_MAX_OUTPUT * scale)))
    return prompts, outs
