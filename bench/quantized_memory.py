"""More requests per byte (issue 20): what each KV-cache (and weight) setting costs and buys.

    .venv/bin/python bench/quantized_memory.py                  # both sections, ~30 min
    .venv/bin/python bench/quantized_memory.py --sections real --reps 3

Section ``real``: one worker process per setting (resident memory is per process), the demo
model (SmolLM2-135M: fp32 from its GGUF, bf16, or the file's Q4_1/Q8_0 tensors kept packed, or
int8 per channel), the same 256 cache blocks of 16 tokens:
- resident set size after load and a warm-up run, with the whole KV cache touched (weights,
  cache, compiled code, runtime), and at the end;
- the engine's own accounting (`EngineStats`: KV bytes per token, cache and weight bytes);
- throughput, 16 chat prompts x 64 greedy tokens and 1 x 64, runs rotated across settings (A, B, C, D /
  B, C, D, A / ...), each started once the CPUs are idle (the busy share of the last
  half-second window and the 1-minute load recorded);
- int8 KV with per-token factors (the CPU default, ``int8-kv``) and with per-channel scales
  only (``int8-kv-channel``);
- quality against the fp32 setting: teacher-forced top-1 disagreement and mean |d logprob|
  over the fp32 engine's greedy continuations, and perplexity of `QUALITY_TEXT` (written for
  this benchmark; the KV calibration prompt is another text).

Section ``gemma``: quality on Gemma 3 270M (its Q4_K_M file dequantized to fp32 as the
reference) for each KV dtype and for its tensors kept packed or int8 per channel.

Section ``budget`` (the paper's Fig. 12/13 axes): a fixed KV budget (the bytes of the paper
harness's CPU pool: 128 blocks of 8 tokens in fp32) buys each KV dtype its number of blocks.
Per dtype the engine's step cost is fitted on real runs (`bench.paper.run.calibrate`), the
replay clock (real scheduler and KV manager, fitted step times) sweeps ShareGPT-like request
rates, and one real run at 0.7x the replayed sustainable rate checks the replay. Reported:
sustainable rate (normalized latency under the paper's threshold) and average batched
requests at the fp32 setting's sustainable rate (Fig. 13's axis).

Writes ``bench/results/<device>/quantized_memory.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8-kv": {"kv_cache_dtype": "int8"},  # per-token factors: the CPU default
    "int8-kv-channel": {"kv_cache_dtype": "int8", "kv_scale_granularity": "per_channel"},
    "fp8_e4m3-kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2-kv": {"kv_cache_dtype": "fp8_e5m2"},
    "q4-weights": {"quantization": "gguf"},  # the file's Q4_1 / Q8_0 tensors, packed
    "int8-weights": {"quantization": "int8"},
    "q4-weights+int8-kv": {"quantization": "gguf", "kv_cache_dtype": "int8"},
}
NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 256, 16, 512
QUALITY_TEXT = """\
Rivers carve valleys over thousands of years, carrying sand and silt from the mountains to the
sea. Where a river slows near its mouth, the sediment settles and builds a delta, a fan of land
split by many small channels. Farmers have long prized deltas for their rich soil, while the
shifting channels make them hard to build on. A city on a delta must keep dredging its harbour,
raise its streets above the floods, and watch the coastline move a little every decade.
"""


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    kb = lambda k: int(fields[k].split()[0])  # noqa: E731
    return kb("VmRSS") / 1024, kb("VmHWM") / 1024


# ---- worker (one setting per process) ---------------------------------------------------
def worker(name: str) -> None:
    from dataclasses import asdict

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.offline_throughput import PROMPTS
    from bench.paper.engine_setup import demo_model
    from pagedjax import LLM, SamplingParams
    from pagedjax.worker.host_heap import release_freed_memory

    kw = dict(SETTINGS[name])
    dtype = kw.pop("dtype", None)
    if kw.get("quantization") == "gguf":
        from models.demo import ensure_demo_model
        from models.gguf_loader import load_gguf

        config, params = load_gguf(ensure_demo_model(), packed=True)
        tok = demo_model()[2]
    else:
        config, params, tok = demo_model()
    if dtype is not None:
        params = jax.tree.map(lambda a: a.astype(dtype), params)
    llm = LLM.from_params(config, params, tok, num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                          max_model_len=MAX_LEN, **kw)
    del params
    release_freed_memory()  # as `LLMEngine.from_model` does once the checkpoint is dropped
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.chat(msgs, greedy, use_tqdm=False)  # compiles every shape the timed runs take:
    llm.chat(msgs[:1], greedy, use_tqdm=False)  # the batch of 16 and the batch of 1
    # Touch the whole cache so the resident set holds it (zero pages may be mapped lazily).
    runner = llm.engine.runner
    runner.k_cache, runner.v_cache = (jax.block_until_ready(jnp.copy(c))
                                      for c in (runner.k_cache, runner.v_cache))

    def teacher_forced(seqs, starts):
        res = llm.generate([{"prompt_token_ids": s} for s in seqs],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)
        tops, lps = [], []
        for r, s, st in zip(res, seqs, starts, strict=True):
            for i in range(st, len(s)):
                d = r.prompt_logprobs[i]
                tops.append(int(max(d, key=d.get)))
                lps.append(float(d[s[i]]))
        return tops, lps

    for line in sys.stdin:
        job = json.loads(line)
        try:
            if job["op"] == "load":
                st = llm.engine.get_stats()
                out = {k: v for k, v in asdict(st).items() if k in (
                    "kv_cache_dtype", "kv_bytes_per_token", "kv_cache_bytes", "weights_bytes",
                    "num_gpu_blocks")}
                out["rss_mb"], out["peak_rss_mb"] = _rss_mb()
            elif job["op"] == "throughput":
                t0 = time.perf_counter()
                outs = llm.chat(msgs[: job.get("n", len(msgs))], greedy, use_tqdm=False)
                dt = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                out = {"tok_s": n / dt, "seconds": dt,
                       "seqs": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                                for o in outs],
                       "starts": [len(o.prompt_token_ids) for o in outs]}
            elif job["op"] == "quality":
                tops, lps = teacher_forced(job["seqs"], job["starts"])
                ids = tok(QUALITY_TEXT).input_ids
                res = llm.generate([{"prompt_token_ids": ids}],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0),
                                   use_tqdm=False)[0]
                nll = [-float(d[t]) for d, t in zip(res.prompt_logprobs[1:], ids[1:], strict=True)]
                out = {"tops": tops, "lps": lps, "ppl": float(np.exp(np.mean(nll)))}
            elif job["op"] == "rss":
                out = dict(zip(("rss_mb", "peak_rss_mb"), _rss_mb(), strict=True))
            else:
                out = {"error": f"unknown op {job['op']}"}
        except Exception as e:  # noqa: BLE001 - reported to the driver
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


class Worker:
    def __init__(self, name: str, log: Path) -> None:
        self.name = name
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=ROOT)

    def run(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died; see {self.log.name}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}")
        return res

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def real_section(names: list[str], reps: int, logdir: Path) -> dict:
    import numpy as np

    from bench.offline_throughput import wait_quiet

    workers = {n: Worker(n, logdir / f"quantized_{n}.log") for n in names}
    try:
        loaded = {n: w.run(op="load") for n, w in workers.items()}
        runs: dict[str, list] = {n: [] for n in names}
        runs1: dict[str, list] = {n: [] for n in names}
        ref = None
        for r in range(reps):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                for batch, store in ((16, runs), (1, runs1)):
                    busy = wait_quiet()  # the CPUs idle (no other worker still busy) first
                    load = os.getloadavg()[0]
                    res = workers[n].run(op="throughput", n=batch)
                    store[n].append({"tok_s": round(res["tok_s"], 2), "load_1m": load,
                                     "busy_before": round(busy, 3)})
                    if n == "fp32" and batch == 16 and ref is None:
                        ref = res
                    print(f"  rep {r} {n} x{batch}: {res['tok_s']:.1f} tok/s (load {load:.2f}, "
                          f"busy before {busy:.2f})", flush=True)
        quality = {n: workers[n].run(op="quality", seqs=ref["seqs"], starts=ref["starts"])
                   for n in names}
        base = quality["fp32"]
        out = {}
        for n in names:
            q = quality[n]
            tops, lps = np.asarray(q["tops"]), np.asarray(q["lps"])
            out[n] = {**loaded[n], **{f"end_{k}": v for k, v in workers[n].run(op="rss").items()},
                      "settings": SETTINGS[n], "runs": runs[n], "runs_batch1": runs1[n],
                      "tok_s_median": float(np.median([x["tok_s"] for x in runs[n]])),
                      "tok_s_batch1_median": float(np.median([x["tok_s"] for x in runs1[n]])),
                      "top1_disagreement": float(np.mean(tops != np.asarray(base["tops"]))),
                      "mean_abs_dlogprob": float(np.mean(np.abs(lps - np.asarray(base["lps"])))),
                      "positions": len(tops), "perplexity": q["ppl"]}
        return out
    finally:
        for w in workers.values():
            w.close()


# ---- budget section (replay clock, as the paper's evaluation) -----------------------------
def budget_section(names: list[str], commit: str = "") -> dict:
    from bench.paper.engine_setup import demo_model
    from bench.paper.figures import Panel, sweep_panel
    from bench.paper.real import run_real
    from bench.paper.replay import replay
    from bench.paper.run import at_rate, calibrate, engine_kw, setup, validation_trace
    from pagedjax import LLM
    from pagedjax.config import EngineConfig
    from pagedjax.worker.model_runner import kv_bytes_per_block, resolve_token_scales
    from pallas_kernels.kv_quant import resolve_kv_cache_dtype

    config, params, tok = demo_model()
    cfg = setup(quick=True)
    fp32_block = kv_bytes_per_block(config, cfg["block_size"], "float32")
    budget = cfg["num_blocks"] * fp32_block  # the harness's CPU pool, in fp32 bytes
    out = {"budget_bytes": budget, "workload": "sharegpt-like x0.125", "per_dtype": {}}
    costs = {}
    for n in names:
        kv = SETTINGS[n].get("kv_cache_dtype", "auto")
        dt = resolve_kv_cache_dtype(kv, "float32")
        factors = resolve_token_scales(EngineConfig(**SETTINGS[n]), dt, "cpu")
        per_block = kv_bytes_per_block(config, cfg["block_size"], dt, None, factors)
        c = {**cfg, "num_blocks": int(budget // per_block)}
        llm = LLM.from_params(config, params, tok, num_gpu_blocks=c["num_blocks"],
                              block_size=c["block_size"], max_model_len=c["max_model_len"],
                              max_num_seqs=c["max_num_seqs"],
                              max_num_batched_tokens=c["max_num_batched_tokens"],
                              **SETTINGS[n])
        eng = llm.engine
        print(f"budget {n}: {c['num_blocks']} blocks ...", flush=True)
        cost, _, _ = calibrate(eng, c, set())
        kw = engine_kw(c)
        panel = Panel("rate", "sharegpt", c["scale"], {"paged": ("paged", {})})
        sw = sweep_panel(panel, c, cost, kw, c["replay_requests"])["systems"]["paged"]
        rate = sw["sustainable_rate"] or sw["rates"][0]
        real_rate = 0.7 * rate
        trace = validation_trace(c, "sharegpt", int(min(c["real_requests"],
                                                        max(8, round(60 * real_rate)))), real_rate)
        real, _ = run_real(eng, "paged", trace, cost=cost)
        rep = replay("paged", trace, cost, **kw)
        costs[n] = (c, cost, kw)
        out["per_dtype"][n] = {
            "num_blocks": c["num_blocks"], "token_slots": c["num_blocks"] * c["block_size"],
            "kv_bytes_per_block": per_block, "commit": commit,
            "sustainable_rate": sw["sustainable_rate"], "rates": sw["rates"],
            "normalized_latency": sw["normalized_latency"],
            "avg_batched_requests": sw["avg_batched_requests"],
            "real_check": {"rate": real_rate, "real": real["normalized_latency_s_per_token"],
                           "replay": rep["normalized_latency_s_per_token"]},
            "cost_model": list(cost.coef)}
        del llm, eng
    ref_rate = out["per_dtype"][names[0]]["sustainable_rate"]
    out["at_reference_rate"] = {"rate": ref_rate}
    for n, (c, cost, kw) in costs.items():
        r = at_rate("sharegpt", ref_rate, c, cost, kw, systems=("paged",))["paged"]
        out["at_reference_rate"][n] = {"avg_batched_requests": r["avg_batched_requests"],
                                       "normalized_latency": r["normalized_latency_s_per_token"]}
    return out


def gemma_quality_section() -> dict:
    """Quality on Gemma 3 270M (its Q4_K_M file dequantized to fp32 as the reference): each KV
    dtype and weight setting against it, teacher-forced over the reference's greedy
    continuations of the bench prompts, and the perplexity of `QUALITY_TEXT`."""
    import numpy as np

    from bench.offline_throughput import PROMPTS
    from models.demo import GEMMA3_270M, ensure_model
    from models.gguf_loader import load_gguf
    from models.tokenizer import load_tokenizer
    from pagedjax import LLM, SamplingParams

    path = ensure_model(GEMMA3_270M)
    tok = load_tokenizer(path)
    config, params = load_gguf(path)
    settings = {"fp32": {}, "int8-kv": {"kv_cache_dtype": "int8"},
                "int8-kv-channel": SETTINGS["int8-kv-channel"],
                "fp8_e4m3-kv": {"kv_cache_dtype": "fp8_e4m3"},
                "fp8_e5m2-kv": {"kv_cache_dtype": "fp8_e5m2"},
                "q4_k_m-weights": {"quantization": "gguf"}, "int8-weights": {"quantization": "int8"}}
    kw = dict(num_gpu_blocks=160, block_size=16, max_model_len=256)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    out, ref = {}, None
    for name, s in settings.items():
        cfg, prm = (load_gguf(path, packed=True) if s.get("quantization") == "gguf"
                    else (config, params))
        llm = LLM.from_params(cfg, prm, tok, **kw, **s)
        if ref is None:
            outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
            ref = ([list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
                   [len(o.prompt_token_ids) for o in outs])
        res = llm.generate([{"prompt_token_ids": q} for q in ref[0]],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        tops, lps = [], []
        for r, q, st in zip(res, ref[0], ref[1], strict=True):
            for i in range(st, len(q)):
                d = r.prompt_logprobs[i]
                tops.append(max(d, key=d.get))
                lps.append(d[q[i]])
        ids = tok(QUALITY_TEXT).input_ids
        pr = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1,
                                                                      prompt_logprobs=0),
                          use_tqdm=False)[0]
        nll = [-d[t] for d, t in zip(pr.prompt_logprobs[1:], ids[1:], strict=True)]
        out[name] = {"tops": tops, "lps": lps, "ppl": float(np.exp(np.mean(nll))),
                     "weights_bytes": llm.engine.get_stats().weights_bytes}
        print(f"  gemma3 {name}: ppl {out[name]['ppl']:.2f}", flush=True)
        del llm
    base = out["fp32"]
    return {n: {"top1_disagreement": float(np.mean(np.asarray(d["tops"]) != np.asarray(base["tops"]))),
                "mean_abs_dlogprob": float(np.mean(np.abs(np.asarray(d["lps"]) -
                                                          np.asarray(base["lps"])))),
                "perplexity": d["ppl"], "positions": len(d["tops"]),
                "weights_bytes": d["weights_bytes"], "settings": settings[n]}
            for n, d in out.items()}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, budget = res.get("real"), res.get("budget")
    panels = [p for p in (real, real, budget) if p]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4))
    axes = list(axes) if len(panels) > 1 else [axes]
    i = 0
    if real:
        names = list(real)
        axes[i].bar(names, [real[n]["kv_cache_bytes"] / 2**20 for n in names], color="tab:orange",
                    label="KV cache")
        axes[i].bar(names, [real[n]["weights_bytes"] / 2**20 for n in names],
                    bottom=[real[n]["kv_cache_bytes"] / 2**20 for n in names], color="tab:blue",
                    label="weights")
        axes[i].plot(names, [real[n]["rss_mb"] for n in names], "k^", label="resident (RSS)")
        axes[i].set_ylabel("MiB")
        axes[i].set_title(f"{NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens")
        axes[i].legend(fontsize=8)
        axes[i].tick_params(axis="x", rotation=30)
        xs = np.arange(len(names))
        axes[i + 1].bar(xs - 0.2, [real[n]["tok_s_median"] for n in names], 0.4,
                        color="tab:green", label="16 x 64")
        axes[i + 1].bar(xs + 0.2, [real[n].get("tok_s_batch1_median", 0) for n in names], 0.4,
                        color="tab:olive", label="1 x 64")
        for j, n in enumerate(names):
            axes[i + 1].text(j, real[n]["tok_s_median"], f"{100 * real[n]['top1_disagreement']:.1f}%",
                             ha="center", va="bottom", fontsize=8)
        axes[i + 1].set_xticks(xs, names)
        axes[i + 1].legend(fontsize=8)
        axes[i + 1].set_ylabel("generated tokens / s (label: top-1 disagreement)")
        axes[i + 1].set_title("greedy, 64 new tokens")
        axes[i + 1].tick_params(axis="x", rotation=30)
        i += 2
    if budget:
        for n, d in budget["per_dtype"].items():
            axes[i].plot(d["rates"], d["normalized_latency"], "o-",
                         label=f"{n} ({d['token_slots']} slots)")
        axes[i].set_xlabel("request rate (req/s)")
        axes[i].set_ylabel("normalized latency (s/token)")
        axes[i].set_title(f"same KV budget ({budget['budget_bytes'] / 2**20:.0f} MiB), replay")
        axes[i].set_yscale("log")
        axes[i].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sections", default="real,gemma,budget")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    import jax

    from bench.results_dir import RESULTS, device_tag

    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(f"1-minute load average {load:.2f} > {args.max_load}: a busy machine "
                         "gives no result (--max-load to override)")
    names = args.settings.split(",")
    out = Path(args.out or RESULTS / device_tag() / "quantized_memory.json")
    sections = set(args.sections.split(","))
    res = (json.loads(out.read_text()) if out.exists() and sections != {"real", "gemma", "budget"}
           else {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res.update({"what": "bench/quantized_memory.py (see its docstring)",
                "command": "python bench/quantized_memory.py " + " ".join(sys.argv[1:]),
                "machine": {"cpu": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
                "versions": {"jax": jax.__version__, "python": platform.python_version()}})
    res.setdefault("commits", {})
    if "real" in sections:
        if "fp32" not in names:
            raise SystemExit("--settings: fp32 is the quality reference; include it")
        rows = real_section(names, args.reps, Path(tempfile.mkdtemp(prefix="qmem-")))
        for row in rows.values():
            row["commit"] = commit
        # A subset of settings replaces those rows and keeps the others (each row names the
        # commit it was measured at).
        for row in res.get("real", {}).values():
            row.setdefault("commit", res["commits"].get("real"))
        res["real"] = {**res.get("real", {}), **rows}
        res["commits"]["real"] = commit
    if "gemma" in sections:
        res["gemma3_quality"] = gemma_quality_section()
        res["commits"]["gemma3_quality"] = commit
    if "budget" in sections:
        new = budget_section([n for n in names if n in ("fp32", "int8-kv", "int8-kv-channel",
                                                         "fp8_e4m3-kv", "fp8_e5m2-kv")], commit)
        old = res.get("budget", {})
        if old and old.get("budget_bytes") == new["budget_bytes"]:
            # A subset of settings replaces those rows (each names its commit); the
            # reference-rate comparison is this run's only (its fp32 rate).
            for row in old.get("per_dtype", {}).values():
                row.setdefault("commit", res["commits"].get("budget"))
            new["per_dtype"] = {**old.get("per_dtype", {}), **new["per_dtype"]}
        res["budget"] = new
        res["commits"]["budget"] = commit
    res["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
