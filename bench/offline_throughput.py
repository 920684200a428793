"""Offline generation throughput: pagedjax vs HF transformers batched ``generate`` (issue 4).

    .venv/bin/python bench/offline_throughput.py [--hf-python /tmp/hfenv/bin/python]

Demo model (SmolLM2-135M, fp32 dequantized from GGUF), 64 prompts x 128 output tokens, greedy,
EOS ignored so both sides generate exactly 128 tokens. The HF side runs in a separate
interpreter (torch is not installable in the project venv) with the same prompt token ids;
we report tokens/s for both and how many greedy outputs are identical. Also measures host
overhead per decode step (schedule + ``build_step_inputs``) at 32/128/256 running sequences.

This file doubles as the HF worker (``--hf-worker IN OUT``), so it imports nothing heavy at
module level.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The history of the printing press", "How do airplanes stay in the air?",
    "Write a short poem about the ocean.", "Explain photosynthesis to a child.",
    "List three benefits of regular exercise.", "What is the capital of France and why is it famous?",
    "Describe a sunset over the mountains.", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers?", "Tips for learning a new language:",
    "The future of renewable energy", "Explain how a computer stores data.",
    "A story about a robot who learns to paint.", "What causes earthquakes?",
]


def make_prompt_ids(tokenizer, n: int) -> list[list[int]]:
    """n prompts (16 texts, varied by a numbered prefix) as token ids."""
    return [tokenizer(f"Question {i}: {PROMPTS[i % len(PROMPTS)]}").input_ids for i in range(n)]


# -- HF worker (runs under --hf-python) ------------------------------------------------------
def hf_worker(inp: str, out: str) -> None:
    # bench/ holds kernels.py, which would shadow the `kernels` package transformers probes.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch
    from transformers import AutoModelForCausalLM

    job = json.load(open(inp))
    torch.set_num_threads(job["threads"])
    path = Path(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32).eval()
    prompts, new = job["prompt_ids"], job["max_tokens"]
    width = max(len(p) for p in prompts)
    pad = job["pad_id"]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)  # warm-up
        t = time.perf_counter()
        gen = model.generate(ids, **kwargs)
        dt = time.perf_counter() - t
    outs = gen[:, width:].tolist()
    json.dump({"seconds": dt, "outputs": outs, "torch": torch.__version__,
               "transformers": __import__("transformers").__version__}, open(out, "w"))


def run_hf(hf_python: str, gguf: Path, prompt_ids, max_tokens: int, pad_id: int) -> dict | None:
    if not Path(hf_python).exists():
        print(f"HF interpreter {hf_python} not found: skipping the HF baseline", flush=True)
        return None
    with tempfile.TemporaryDirectory() as d:
        inp, outp = Path(d) / "in.json", Path(d) / "out.json"
        json.dump({"gguf": str(gguf), "prompt_ids": prompt_ids, "max_tokens": max_tokens,
                   "pad_id": pad_id, "threads": os.cpu_count()}, open(inp, "w"))
        r = subprocess.run([hf_python, __file__, "--hf-worker", str(inp), str(outp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print("HF worker failed:\n" + r.stderr[-3000:], flush=True)
            return None
        return json.load(open(outp))


# -- pagedjax -----------------------------------------------------------------------------
def run_pagedjax(config, params, tok, prompt_ids, max_tokens: int) -> dict:
    from pagedjax import LLM
    from pagedjax.sampling_params import SamplingParams

    llm = LLM.from_params(config, params, tok, num_gpu_blocks=1024, block_size=16, max_num_seqs=64,
                          max_num_batched_tokens=4096, max_model_len=512)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_ids, sp, use_tqdm=False)  # warm-up: compiles every bucket of the timed run
    t = time.perf_counter()
    outs = llm.generate(prompt_ids, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    return {"seconds": dt, "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "num_steps": llm.engine.num_steps}


def host_overhead(num_seqs: int, context: int = 128, block_size: int = 16, steps: int = 50) -> dict:
    """Median host time of one decode step's schedule + build_step_inputs (no device work)."""
    from pagedjax.core import BlockManager, Scheduler, SchedulerConfig, Sequence, SequenceGroup
    from pagedjax.worker.step_inputs import build_step_inputs

    max_len = context + steps + 8
    bm = BlockManager(num_seqs * (-(-max_len // block_size)) + 8, 0, block_size)
    sched = Scheduler(SchedulerConfig(max_model_len=max_len, max_num_seqs=num_seqs,
                                      max_num_batched_tokens=max(num_seqs, 2048)), bm)
    groups = []
    for i in range(num_seqs):
        g = SequenceGroup(f"r{i}", [Sequence(i, list(range(100, 100 + context)))], 0.0, max_tokens=10**6)
        sched.add_seq_group(g)
        groups.append(g)
    max_blocks = -(-max_len // block_size)
    times, sched_t = [], []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        build_step_inputs(out.scheduled, block_size, max_blocks)
        t2 = time.perf_counter()
        sched.update_after_step(out)
        for g in groups:
            g.seqs[0].append_token(5)
        if k:  # step 0 is the prefill
            times.append(t2 - t0)
            sched_t.append(t1 - t0)
    times.sort()
    sched_t.sort()
    return {"num_seqs": num_seqs, "median_ms": 1e3 * times[len(times) // 2],
            "median_schedule_ms": 1e3 * sched_t[len(sched_t) // 2],
            "p90_ms": 1e3 * times[int(0.9 * len(times))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-python", default="/tmp/hfenv/bin/python")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/cpu/offline_throughput.json")
    ap.add_argument("--hf-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        hf_worker(*args.hf_worker)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models.demo import ensure_demo_model
    from models.gguf_loader import load_gguf
    from models.tokenizer import load_tokenizer

    gguf = Path(ensure_demo_model())
    config, params = load_gguf(gguf)
    tok = load_tokenizer(gguf)
    prompt_ids = make_prompt_ids(tok, args.num_prompts)
    n_tok = args.num_prompts * args.max_tokens
    res: dict = {"model": gguf.name, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                 "greedy": True, "cpu_count": os.cpu_count()}
    print("host overhead ...", flush=True)
    res["host_overhead"] = [host_overhead(n) for n in (32, 128, 256)]
    print(res["host_overhead"], flush=True)
    print("pagedjax ...", flush=True)
    pj = run_pagedjax(config, params, tok, prompt_ids, args.max_tokens)
    res["pagedjax"] = {"seconds": pj["seconds"], "tokens_per_s": n_tok / pj["seconds"]}
    print(res["pagedjax"], flush=True)
    print("HF transformers ...", flush=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    hf = run_hf(args.hf_python, gguf, prompt_ids, args.max_tokens, int(pad))
    if hf is not None:
        same = [a == b for a, b in zip(pj["outputs"], hf["outputs"])]
        prefix = []
        for a, b in zip(pj["outputs"], hf["outputs"]):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(k)
        res["hf"] = {"seconds": hf["seconds"], "tokens_per_s": n_tok / hf["seconds"],
                     "torch": hf["torch"], "transformers": hf["transformers"]}
        res["speedup_vs_hf"] = res["pagedjax"]["tokens_per_s"] / res["hf"]["tokens_per_s"]
        res["identical_greedy_outputs"] = f"{sum(same)}/{len(same)}"
        res["mean_agreeing_prefix_tokens"] = sum(prefix) / len(prefix)
    print(json.dumps({k: v for k, v in res.items()}, indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["pagedjax"] + (["HF generate"] if "hf" in res else [])
    vals = [res["pagedjax"]["tokens_per_s"]] + ([res["hf"]["tokens_per_s"]] if "hf" in res else [])
    a.bar(names, vals)
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    a.set_ylabel("output tokens/s")
    a.set_title(f"{res['num_prompts']}x{res['max_tokens']} greedy, CPU")
    ho = res["host_overhead"]
    b.plot([h["num_seqs"] for h in ho], [h["median_ms"] for h in ho], marker="o", label="schedule+inputs")
    b.axhline(1.0, color="gray", ls="--", label="1 ms target")
    b.set_xlabel("running sequences")
    b.set_ylabel("host ms / decode step")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
