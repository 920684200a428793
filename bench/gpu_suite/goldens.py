"""CPU goldens for the seeded models and the GPU-side "plan" that is checked against them.

Golden (written by ``tools/make_gpu_goldens.py``, fp32, XLA attention, no engine features):
for six token-id prompts (three share a 64-token prefix) the greedy continuation (24 tokens),
a width-4 beam search on two prompts, and teacher-forced top-8 logprobs at stored positions of
``prompt + continuation`` (every decision position of the continuation, every 8th prompt
position). Storing top-8 ids and values only keeps each file near 40 KB.

Plan (what the GPU runs, in fp32 and bf16, Pallas attention): one engine with chunked prefill
(32-token budget) and a 16-block KV pool (so requests preempt), then

* ``score``: the same sequences with ``prompt_logprobs=8`` (recompute preemption);
* ``greedy_recompute`` / ``greedy_swap``: the prompts, greedy, prefix caching on;
* ``beam``: width-4 beam search (copy-on-write forks), prefix caching on.

Each run records how often the features fired (preemptions, swapped blocks, prefix-cache hit
tokens, partial prompt chunks, block copies) so a pass cannot come from a path never taken.

Checks (tolerances are stored in the golden file with the CPU measurements they come from):

* logprobs: at every stored position, every golden top-8 id's logprob within ``tol``; an id
  missing from the run's top-8 must have a golden value <= the run's 8th value + ``tol``.
* top-1: agreement >= 99 % over *decisive* positions (golden top-1/top-2 margin >= ``tie``:
  1e-4 in fp32, ``tol / 2`` in bf16); the raw agreement over all positions is reported beside
  it. bf16 cannot order logits closer than its resolution: with these random-weight models
  ~10 % of positions have margins under 0.02 nats and CPU bf16 itself flips some of them
  (measured, in the file).
* greedy continuations: equal up to the first divergence; a divergence must sit where the
  golden margin is < 2 * ``tol`` (the only place a flip is consistent with the logprob check).
* beam: the best beam's cumulative logprob within ``tol * max_tokens`` of the golden's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_suite.common import REPO
from bench.gpu_suite.seeded import SPECS, ModelSpec, NoTokenizer, fingerprint

GOLDEN_DIR = REPO / "tests" / "data" / "gpu_goldens"
GOLDEN_MODELS = ("demo", "llama3_8b_2l")
TOP_K = 8
GEN_TOKENS = 24
PROMPT_LENGTHS = (9, 33, 70, 100)
SHARED_PREFIX, SHARED_TAILS = 64, (20, 37)  # two more prompts: prompt 3's first 64 + a tail
BEAM_WIDTH, BEAM_TOKENS, BEAM_PROMPTS = 4, 8, (0, 3)
PROMPT_STRIDE = 8  # stored prompt positions: every 8th
TOL_FP32 = 2e-3
TOL_BF16_MIN = 0.1
TIE_FP32 = 1e-4
TOP1_MIN = 0.99

# "No engine features": both off explicitly since they became the defaults (stop 57).
GOLDEN_ENGINE = dict(block_size=16, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                     max_model_len=256, warmup=False, enable_prefix_caching=False,
                     enable_chunked_prefill=False)
PLAN_ENGINE = dict(block_size=16, num_gpu_blocks=16, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=256, enable_chunked_prefill=True, warmup=False)


def make_prompts(spec: ModelSpec) -> list[list[int]]:
    rng = np.random.default_rng([spec.seed, 7])
    lo = min(100, spec.config.vocab_size // 4)
    prompts = [rng.integers(lo, spec.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    base = prompts[3][:SHARED_PREFIX]
    prompts += [base + rng.integers(lo, spec.config.vocab_size, n).tolist() for n in SHARED_TAILS]
    return prompts


def build_llm(spec: ModelSpec, params: dict, engine_kw: dict, backend: str):
    from pagedjax import LLM

    return LLM.from_params(spec.config, params, NoTokenizer(), attention_backend=backend, **engine_kw)


def _greedy(max_tokens: int, logprobs: int | None = None):
    from pagedjax import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def _top(entry: dict[int, float], k: int = TOP_K) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def stored_positions(prompt_len: int, total_len: int) -> list[int]:
    """Positions p (logits at p predict token p + 1) kept in the golden file."""
    return sorted(set(range(0, prompt_len - 1, PROMPT_STRIDE)) | set(range(prompt_len - 1, total_len - 1)))


def score(llm, seqs: list[list[int]]) -> list[list[dict[int, float] | None]]:
    """Teacher-forced top-8 logprobs: entry p is the distribution at position p."""
    from pagedjax import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    _check_errors(outs)
    return [o.prompt_logprobs[1:] for o in outs]


def _check_errors(outs) -> None:
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"engine failed requests: {bad[:2]}")


def compute_golden(spec: ModelSpec, params: dict) -> dict[str, Any]:
    """The golden record of ``spec`` (fp32 params, XLA attention, no engine features)."""
    import jax

    from pagedjax import SamplingParams

    llm = build_llm(spec, params, GOLDEN_ENGINE, "xla")
    prompts = make_prompts(spec)
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(GEN_TOKENS), use_tqdm=False)
    _check_errors(gen)
    greedy = [o.outputs[0].token_ids for o in gen]
    seqs = [p + g for p, g in zip(prompts, greedy)]
    scored_all = score(llm, seqs)
    scored = []
    for p, s, lp in zip(prompts, seqs, scored_all):
        pos = stored_positions(len(p), len(s))
        tops = [_top(lp[i]) for i in pos]
        scored.append({"positions": pos, "top_ids": [[t for t, _ in tp] for tp in tops],
                       "top_lps": [[round(v, 6) for _, v in tp] for tp in tops]})
    beam_sp = SamplingParams(n=1, best_of=BEAM_WIDTH, use_beam_search=True, max_tokens=BEAM_TOKENS,
                             ignore_eos=True, temperature=0.0)
    beams = llm.generate([{"prompt_token_ids": prompts[i]} for i in BEAM_PROMPTS], beam_sp, use_tqdm=False)
    _check_errors(beams)
    return {
        "model": spec.name, "about": spec.about, "seed": spec.seed, "config": spec.config.to_dict(),
        "fingerprint": fingerprint(spec.config, spec.seed),
        "made_with": {"jax": jax.__version__, "numpy": np.__version__, "backend": "xla",
                      "dtype": "float32", "engine": GOLDEN_ENGINE},
        "prompts": prompts, "greedy": greedy, "scored": scored,
        "beam": {"width": BEAM_WIDTH, "max_tokens": BEAM_TOKENS, "prompts": list(BEAM_PROMPTS),
                 "best": [b.outputs[0].token_ids for b in beams],
                 "cumulative_logprob": [b.outputs[0].cumulative_logprob for b in beams]},
        # Defaults; tools/make_gpu_goldens.py replaces them with values calibrated on CPU runs.
        "tolerance": {"float32": TOL_FP32, "bfloat16": TOL_BF16_MIN},
        "tie_margin": {"float32": TIE_FP32, "bfloat16": TOL_BF16_MIN / 2}, "top1_min": TOP1_MIN,
    }


# ---- checks ---------------------------------------------------------------------------------
def compare_scores(golden: dict, run_scored: list[list[dict | None]], tol: float, tie: float) -> dict:
    """Logprob and top-1 agreement of a scoring run with the golden's stored positions."""
    max_diff, n, agree, decisive, agree_decisive, bad_positions = 0.0, 0, 0, 0, 0, []
    flips = []
    for gi, g in enumerate(golden["scored"]):
        lp = run_scored[gi]
        for p, ids, vals in zip(g["positions"], g["top_ids"], g["top_lps"]):
            entry = lp[p] if p < len(lp) else None
            if entry is None:
                bad_positions.append((gi, p, "missing"))
                continue
            run_top = _top(entry)
            eighth = run_top[-1][1]
            for t, v in zip(ids, vals):
                if t in entry:  # in the run's top-8, or the actual next token (always reported)
                    d = abs(entry[t] - v)
                    max_diff = max(max_diff, d)
                    if d > tol:
                        bad_positions.append((gi, p, f"id {t}: {entry[t]:.5f} vs {v:.5f}"))
                elif v - tol > eighth:
                    bad_positions.append((gi, p, f"id {t} ({v:.5f}) missing from run top-8 "
                                                 f"(8th {eighth:.5f})"))
            n += 1
            same = run_top[0][0] == ids[0]
            agree += same
            margin = vals[0] - vals[1]
            if margin >= tie:
                decisive += 1
                agree_decisive += same
            if not same:
                flips.append(round(margin, 5))
    top1 = agree_decisive / decisive if decisive else math.nan
    return {"positions": n, "max_abs_diff": max_diff, "tol": tol, "violations": len(bad_positions),
            "violation_examples": bad_positions[:5], "top1_raw": agree / n if n else math.nan,
            "decisive_positions": decisive, "top1_decisive": top1, "tie_margin": tie,
            "flip_margins": flips[:20],
            "ok": (not bad_positions and n > 0 and decisive > 0 and top1 >= golden["top1_min"])}


def _margin_at(golden: dict, prompt_index: int, pos: int) -> float | None:
    g = golden["scored"][prompt_index]
    if pos in g["positions"]:
        vals = g["top_lps"][g["positions"].index(pos)]
        return vals[0] - vals[1]
    return None


def compare_greedy(golden: dict, run_tokens: list[list[int]], tol: float) -> dict:
    """Continuations equal up to the first divergence, which must be at a golden near-tie."""
    matched, total, divergences, unexplained = 0, 0, [], []
    for i, (want, got) in enumerate(zip(golden["greedy"], run_tokens)):
        total += len(want)
        j = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if j is None and len(got) != len(want):
            j = min(len(got), len(want))
        if j is None:
            matched += len(want)
            continue
        matched += j
        margin = _margin_at(golden, i, len(golden["prompts"][i]) - 1 + j)
        d = {"prompt": i, "at": j, "golden_margin": margin}
        divergences.append(d)
        if margin is None or margin >= 2 * tol:
            unexplained.append(d)
    return {"tokens_matched": matched, "tokens": total, "divergences": divergences,
            "unexplained": unexplained, "ok": not unexplained and total > 0}


def compare_beam(golden: dict, outs, tol: float) -> dict:
    b = golden["beam"]
    rows, ok = [], True
    for want, want_lp, o in zip(b["best"], b["cumulative_logprob"], outs):
        got, got_lp = o.outputs[0].token_ids, o.outputs[0].cumulative_logprob
        diff = abs(got_lp - want_lp) if got_lp is not None and want_lp is not None else math.inf
        good = diff <= tol * b["max_tokens"]
        ok &= good
        rows.append({"identical": got == want, "cum_logprob": got_lp, "golden_cum_logprob": want_lp,
                     "abs_diff": diff, "ok": good})
    return {"beams": rows, "ok": ok and bool(rows)}


# ---- the plan -------------------------------------------------------------------------------
def _instrument(engine) -> dict[str, int]:
    """Count what the scheduler did (call after every ``set_policy``: it swaps the scheduler)."""
    c = dict(steps=0, preemptions=0, blocks_swapped_out=0, blocks_swapped_in=0, blocks_copied=0,
             partial_prompt_chunks=0)
    orig = engine.scheduler.schedule

    def schedule():
        out = orig()
        c["steps"] += 1
        c["preemptions"] += len(out.preempted)
        c["blocks_swapped_out"] += len(out.blocks_to_swap_out)
        c["blocks_swapped_in"] += len(out.blocks_to_swap_in)
        c["blocks_copied"] += len(out.blocks_to_copy)
        c["partial_prompt_chunks"] += sum(1 for s in out.scheduled
                                          if len(s.token_ids) > 1 and not s.needs_logits)
        return out

    engine.scheduler.schedule = schedule
    return c


def run_plan(spec: ModelSpec, params: dict, golden: dict, dtype: str, backend: str,
             on_result=None, keep_raw: bool = False) -> dict[str, Any]:
    """Run the plan on ``params`` (already in ``dtype``); compare each run as it finishes.

    ``keep_raw`` keeps the run's outputs under ``"raw"`` for :func:`recompare` (the golden
    writer calibrates tolerances on them, then re-checks)."""
    import time

    from bench.paper.engine_setup import set_policy
    from pagedjax import SamplingParams

    tol = golden["tolerance"][dtype]
    tie = golden["tie_margin"][dtype]
    t0 = time.monotonic()
    llm = build_llm(spec, params, PLAN_ENGINE, backend)
    eng = llm.engine
    prompts = golden["prompts"]
    results: dict[str, Any] = {"model": spec.name, "dtype": dtype, "backend": backend, "tol": tol}
    raw: dict[str, Any] = {}

    def done(name: str, res: dict, counters: dict, t: float) -> None:
        res["features"] = counters
        res["wall_s"] = round(time.monotonic() - t, 2)
        results[name] = res
        if on_result is not None:
            on_result(name, res)

    t = time.monotonic()
    set_policy(eng, "paged", prefix_caching=False, preemption_mode="recompute")
    c = _instrument(eng)
    seqs = [p + g for p, g in zip(prompts, golden["greedy"])]
    raw["score"] = score(llm, seqs)
    done("score", compare_scores(golden, raw["score"], tol, tie), c, t)

    for mode in ("recompute", "swap"):
        t = time.monotonic()
        set_policy(eng, "paged", prefix_caching=True, preemption_mode=mode)
        c = _instrument(eng)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(GEN_TOKENS, TOP_K),
                            use_tqdm=False)
        _check_errors(outs)
        c["prefix_hit_tokens"] = sum(o.num_cached_tokens for o in outs)
        raw[f"greedy_{mode}"] = [o.outputs[0].token_ids for o in outs]
        done(f"greedy_{mode}", compare_greedy(golden, raw[f"greedy_{mode}"], tol), c, t)

    t = time.monotonic()
    set_policy(eng, "paged", prefix_caching=True, preemption_mode="recompute")
    c = _instrument(eng)
    b = golden["beam"]
    sp = SamplingParams(n=1, best_of=b["width"], use_beam_search=True, max_tokens=b["max_tokens"],
                        ignore_eos=True, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in b["prompts"]], sp, use_tqdm=False)
    _check_errors(outs)
    raw["beam"] = outs
    done("beam", compare_beam(golden, outs, tol), c, t)
    results["wall_s"] = round(time.monotonic() - t0, 2)
    results["ok"] = all(results[k]["ok"] for k in PLAN_RUNS)
    if keep_raw:
        results["raw"] = raw
    return results


PLAN_RUNS = ("score", "greedy_recompute", "greedy_swap", "beam")


def recompare(golden: dict, raw: dict, dtype: str) -> dict[str, dict]:
    """The plan's checks again on kept outputs, with the golden's current tolerances."""
    tol, tie = golden["tolerance"][dtype], golden["tie_margin"][dtype]
    return {"score": compare_scores(golden, raw["score"], tol, tie),
            "greedy_recompute": compare_greedy(golden, raw["greedy_recompute"], tol),
            "greedy_swap": compare_greedy(golden, raw["greedy_swap"], tol),
            "beam": compare_beam(golden, raw["beam"], tol)}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str) -> dict[str, Any]:
    g = json.loads(golden_path(name).read_text())
    if g["model"] not in SPECS:
        raise ValueError(f"golden for unknown model {g['model']!r}")
    return g
