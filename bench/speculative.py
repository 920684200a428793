"""Speculative decoding on the demo model: tokens/s with and without n-gram drafts.

    .venv/bin/python bench/speculative.py [--reps 3] [--k 4] [--max-tokens 128]

Workloads (chat prompts to SmolLM2-135M-Instruct, the demo model, fp32, greedy, one request
at a time = batch 1, and the same prompts as one batch of 4):

* input-grounded — rewrite a given passage, fix a given function: the answer copies long
  spans of the prompt, which is what prompt lookup proposes;
* free-form — open questions whose answers do not repeat the prompt.

The draft-model engine drafts with a truncated copy of the demo model (its first
``--draft-layers`` of 30 layers, same embeddings and head): a stand-in for a smaller model of
the same tokenizer, which the demo has none of, and said so in the results.

Each rep runs plain decoding, n-gram, then draft-model speculation (A, B, C alternated);
decode tokens/s is generated tokens over wall time of `LLM.generate` after a warm-up of the
same prompts (compilations excluded). Outputs must be identical (greedy is lossless). Records
acceptance rate, mean accepted length per drafted step and the load average; refuses to run
on a busy machine. Writes JSON + PNG under ``bench/results/<device>/speculative.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
from results_dir import RESULTS, device_tag  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402

PASSAGE = (
    "The river town of Alder Bend was founded in 1852 by timber merchants who floated logs "
    "down to the mills at the coast. For decades the town grew with the trade, adding a "
    "school, a church and a small railway station. When the mills closed in 1931, most "
    "families left, and the station was abandoned. Today the old warehouses along the river "
    "have been turned into shops and a museum that tells the story of the timber years.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) * (v - m)
    return total / len(values)
'''
WORKLOADS = {
    "input_grounded": [
        f"Rewrite the following passage exactly, but in the present tense:\n\n{PASSAGE}",
        f"Copy this passage and put each sentence on its own line:\n\n{PASSAGE}",
        f"Add a docstring to each function and return the full code:\n\n{CODE}",
        f"Rename the variable `total` to `acc` everywhere and return the code:\n\n{CODE}",
    ],
    "free_form": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give five tips for learning a new language.",
        "Describe a perfect autumn day in the mountains.",
    ],
}


def run(llm: LLM, prompts: list[str], sp: SamplingParams, batch: bool) -> tuple[float, list]:
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    llm.reset_prefix_cache()  # every run computes its prompts (no hits from the last rep)
    t0 = time.perf_counter()
    if batch:
        outs = llm.chat(msgs, sp, use_tqdm=False)
    else:
        outs = [llm.chat([m], sp, use_tqdm=False)[0] for m in msgs]
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return sum(len(t) for t in toks) / dt, toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--lookup-min", type=int, default=2,
                    help="prompt_lookup_min: 1 drafts after any single repeated token, which "
                         "free-form text mostly rejects")
    ap.add_argument("--max-load", type=float, default=0.5)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(f"1-minute load average {load:.2f} > {args.max_load}: a busy machine "
                         "gives no result (--max-load to override)")
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": 4}
    # The draft: a truncated copy of the demo model (its first --draft-layers of 30 layers,
    # same embeddings and head), the stand-in for a smaller model of the tokenizer.
    draft_cfg = {"method": "draft_model", "model": "smollm2",
                 "draft_num_layers": args.draft_layers, "num_speculative_tokens": 3}
    engines = {"plain": LLM(model="smollm2", max_model_len=1024),
               "ngram": LLM(model="smollm2", max_model_len=1024, speculative_config=spec_cfg),
               "draft": LLM(model="smollm2", max_model_len=1024, speculative_config=draft_cfg)}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    res = {"what": "bench/speculative.py (see its docstring)",
           "command": "python bench/speculative.py " + " ".join(sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=ROOT).stdout.strip(),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "versions": {"jax": jax.__version__, "python": platform.python_version()},
           "model": "SmolLM2-135M-Instruct (demo GGUF, fp32)", "speculative_config": spec_cfg,
           "draft_config": draft_cfg,
           "max_tokens": args.max_tokens, "results": {}}
    for workload, prompts in WORKLOADS.items():
        for batch in (False, True):
            key = f"{workload}/{'batch4' if batch else 'batch1'}"
            for llm in engines.values():  # warm-up: every shape this workload meets
                run(llm, prompts, sp, batch)
            tps = {name: [] for name in engines}
            outs = {}
            before = {n: e.engine.get_stats() for n, e in engines.items()}
            for _ in range(args.reps):
                for name, llm in engines.items():
                    t, toks = run(llm, prompts, sp, batch)
                    tps[name].append(t)
                    outs[name] = toks
            for name in ("ngram", "draft"):
                assert outs["plain"] == outs[name], f"{key}: {name} changed the outputs"
            med = {n: statistics.median(v) for n, v in tps.items()}
            row = {"tok_s_runs": {n: [round(x, 1) for x in v] for n, v in tps.items()},
                   "tok_s_median": {n: round(x, 1) for n, x in med.items()},
                   "generated_tokens": sum(len(t) for t in outs["plain"]),
                   "outputs_identical": True}
            for name in ("ngram", "draft"):
                a, b = engines[name].engine.get_stats(), before[name]
                drafted = a.spec_num_draft_tokens - b.spec_num_draft_tokens
                accepted = a.spec_num_accepted_tokens - b.spec_num_accepted_tokens
                steps = a.spec_num_drafts - b.spec_num_drafts
                row[name] = {"speedup": round(med[name] / med["plain"], 2),
                             "acceptance_rate": round(accepted / max(1, drafted), 3),
                             "mean_accepted_length": round(1 + accepted / max(1, steps), 2)}
            res["results"][key] = row
            print(key, row["tok_s_median"], {n: row[n] for n in ("ngram", "draft")}, flush=True)
    res["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    out = RESULTS / device_tag() / "speculative.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = list(res["results"])
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = {"plain": "plain decoding", "ngram": "n-gram speculation",
              "draft": "draft model (first layers of the target)"}
    for i, name in enumerate(labels):
        ax.bar(x + (i - 1) * 0.27, [res["results"][k]["tok_s_median"][name] for k in keys], 0.27,
               label=labels[name])
    for xi, k in zip(x, keys, strict=True):
        r = res["results"][k]
        for i, name in enumerate(("ngram", "draft")):
            ax.text(xi + i * 0.27, r["tok_s_median"][name] * 1.02,
                    f"{r[name]['speedup']}x\n{r[name]['mean_accepted_length']}", ha="center",
                    fontsize=7)
    ax.set_xticks(x, keys)
    ax.set_ylabel("generated tokens / s (greedy)")
    ax.set_title(f"SmolLM2-135M fp32, k={res['speculative_config']['num_speculative_tokens']} (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
