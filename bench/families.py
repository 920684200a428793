"""Model families on CPU: decode throughput at a small config each, and the KV blocks that
window-aware release saves on a long-context workload.

    .venv/bin/python bench/families.py [--reps 2] [--out bench/results/cpu/families.json]

Throughput: every family of `tests/data/family_goldens.json` (the HF-parity configs) scaled to
the same small size — 8 layers, hidden 512, 8 query heads of 64 (KV heads as the family's ratio
gives: 2, or 8 for Phi-3), MLP 1408 or 8 experts of 512 (top-2), vocab 32000, windows of 128
where the family has them — with synthetic weights, fp32, the engine's CPU defaults. The
workload is 16 prompts of 96 tokens, 64 greedy new tokens each (ignore_eos), after a warm-up run
of the same shape; families run in order A..K then K..A per rep, and the median of the timed
runs is reported.

Window memory: a Mistral-like model (every layer windowed, window 128) and a Gemma-3-like one
(5 windowed : 1 global, 6 layers) serve 8 requests of 256 prompt tokens and 512 new tokens
(block size 16). KV memory in use is recorded after every step in layer-blocks (block ids in
use times the layers each id holds: 6 for one table, 1 per KV-cache group for the hybrid
Gemma-like layout), with the engine's behaviour (release behind the window; hybrid groups) and
with a cache that keeps everything (the block manager told the window is 0; for the
Gemma-like model one table for all layers, `disable_hybrid_kv_cache_manager=True`, where the
global layer keeps every block). Outputs must be identical either way. Writes JSON + PNG.

`--sections window` re-measures only the window memory and keeps the file's other section
(each section records the commit it was measured at).
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

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import synthetic  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.weights import assemble_params, expected_shapes  # noqa: E402
from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.core.kv_groups import plan_kv_groups  # noqa: E402
from tests.parallel.tp_script import NoTokenizer  # noqa: E402

GOLDENS = json.loads((ROOT / "tests/data/family_goldens.json").read_text())
BENCH_WINDOW = 128


def bench_config(name: str, **over) -> ModelConfig:
    """The family's HF-parity config at the benchmark size."""
    hf = dict(GOLDENS["families"][name]["config"])
    kv = 8 if hf["num_key_value_heads"] == hf["num_attention_heads"] else 2
    hf.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=kv, head_dim=64,
              num_hidden_layers=8, intermediate_size=1408, vocab_size=32000,
              max_position_embeddings=4096)
    if hf.get("sliding_window"):
        hf["sliding_window"] = BENCH_WINDOW
    if "layer_types" in hf and hf["layer_types"]:
        pattern = hf["layer_types"]
        hf["layer_types"] = [pattern[i % len(pattern)] for i in range(8)]
    if hf.get("num_local_experts") or hf.get("num_experts"):
        key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
        hf[key] = 8
        hf["num_experts_per_tok"] = 2
        if hf["model_type"] == "mixtral":
            hf["intermediate_size"] = 512
        else:
            hf["moe_intermediate_size"] = 512
        if hf.get("shared_expert_intermediate_size"):
            hf["shared_expert_intermediate_size"] = 1024
    if "original_max_position_embeddings" in hf:
        hf["original_max_position_embeddings"] = 4096
    if isinstance(hf.get("rope_parameters"), dict) and "short_factor" in hf["rope_parameters"]:
        rp = dict(hf["rope_parameters"])
        rp["short_factor"] = [1.0 + 0.01 * i for i in range(32)]
        rp["long_factor"] = [1.5 + 0.1 * i for i in range(32)]
        hf["rope_parameters"] = rp
    hf.update(over)
    return ModelConfig.from_hf(hf)


def synthetic_params(config: ModelConfig) -> dict:
    shapes = expected_shapes(config)
    gemma = config.architecture.startswith("gemma")
    return assemble_params(config, lambda n: synthetic.tensors({n: shapes[n]}, gemma=gemma)[n]
                           if n in shapes else None)


def params_count(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def throughput(names: list[str], reps: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 32000, 96)] for _ in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engines = {}
    for name in names:
        config = bench_config(name)
        params = synthetic_params(config)
        llm = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=16)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        engines[name] = (llm, params_count(params), time.perf_counter() - t0)
        print(f"{name}: warm-up {engines[name][2]:.1f} s", flush=True)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            llm = engines[name][0]
            llm.reset_prefix_cache()  # every rep computes its prompts (no hits from the last)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            print(f"rep {rep} {name}: {runs[name][-1]:.0f} tok/s", flush=True)
    return {name: {"params": engines[name][1], "warmup_s": round(engines[name][2], 1),
                   "tok_s_runs": [round(x, 1) for x in runs[name]],
                   "tok_s_median": round(statistics.median(runs[name]), 1)} for name in names}


def window_memory() -> dict:
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 32000, 256)] for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    out = {}
    for label, name in (("all_windowed (Mistral-like)", "mistral"),
                        ("5 local : 1 global (Gemma-3-like)", "gemma3")):
        config = bench_config(name, num_hidden_layers=6, layer_types=(
            ["sliding_attention"] * 5 + ["full_attention"]) if name == "gemma3" else None)
        params = synthetic_params(config)
        series, tokens = {}, {}
        for release in (True, False):
            # The same KV bytes either way: 600 blocks of all 6 layers.
            slots = plan_kv_groups(config.windows, hybrid=release).num_slots
            llm = LLM.from_params(config, params, NoTokenizer(), max_num_seqs=8, block_size=16,
                                  max_model_len=1024, num_gpu_blocks=600 * 6 // slots,
                                  disable_hybrid_kv_cache_manager=not release)
            eng, bm = llm.engine, llm.engine.block_manager
            if not release:
                bm.sliding_window = 0  # keep every block: the baseline cache
            per_id = eng.runner.kv_layout.num_slots  # layers one block id holds
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", None, sp, prompt_token_ids=p)
            held, finals = [], {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        finals[o.request_id] = o.outputs[0].token_ids
                held.append((eng.runner.num_gpu_blocks - bm.get_num_free_gpu_blocks()) * per_id)
            series["release" if release else "keep_all"] = held
            tokens[release] = [finals[f"r{i}"] for i in range(len(prompts))]
            if release:
                groups = eng.runner.kv_layout.group_windows
        assert tokens[True] == tokens[False], "release changed outputs"
        out[label] = {
            "windows": list(config.windows), "kv_groups": list(groups),
            "unit": "layer-blocks (block ids in use x layers per id; 16 tokens each)",
            "peak_layer_blocks": {k: max(v) for k, v in series.items()},
            "mean_layer_blocks": {k: round(statistics.mean(v), 1) for k, v in series.items()},
            "series": series,
        }
        print(label, out[label]["peak_layer_blocks"], out[label]["mean_layer_blocks"], flush=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    tp = res["throughput"]
    names = list(tp)
    a.bar(names, [tp[n]["tok_s_median"] for n in names], color="tab:blue")
    a.set_ylabel("generated tokens / s")
    a.set_title("16 x (96 + 64) tokens, fp32, 8 layers x 512 (CPU)")
    a.tick_params(axis="x", rotation=45)
    for label, r in res["window_memory"].items():
        for k, style in (("release", "-"), ("keep_all", ":")):
            b.plot(r["series"][k], style, label=f"{label}: {k}")
    b.set_xlabel("engine step")
    b.set_ylabel("KV in use (layer-blocks of 16 tokens)")
    b.set_title("8 x (256 + 512) tokens, window 128")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--families", default=",".join(sorted(GOLDENS["families"])))
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/families.json"))
    ap.add_argument("--sections", default="throughput,window")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(f"1-minute load average {load:.2f} > {args.max_load}: a busy machine "
                         "gives no result (--max-load to override)")
    names = args.families.split(",")
    sections = set(args.sections.split(","))
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() and sections != {"throughput", "window"} \
        else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res.update({"what": "bench/families.py (see its docstring)",
                "command": "python bench/families.py " + " ".join(sys.argv[1:]),
                "machine": {"cpu": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
                "versions": {"jax": jax.__version__, "python": platform.python_version()}})
    res.setdefault("commits", {})
    if "throughput" in sections:
        res["throughput"] = throughput(names, args.reps)
        res["commits"]["throughput"] = commit
    if "window" in sections:
        res["window_memory"] = window_memory()
        res["commits"]["window_memory"] = commit
    res["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
