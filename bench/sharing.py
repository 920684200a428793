"""Memory saved by block sharing (paper Fig. 15) and shared-prefix throughput (paper Fig. 16).

Fig. 15: for parallel sampling (n ∈ {2, 4, 6}) and beam search (width ∈ {2, 4, 6}) on Alpaca-like
and ShareGPT-like synthetic length distributions (`bench/workloads.py`: log-normal lengths with
the paper's Fig. 11 means, Alpaca ≈ 19.3 in / 58.5 out tokens, ShareGPT ≈ 161.3 / 338.0 with
higher variance), we run the real engine and sample block usage at every step boundary:

    saving = Σ_steps (blocks without sharing − blocks used) / Σ_steps blocks without sharing

"blocks used" is the GPU pool's referenced block count (shared blocks counted once), "without
sharing" is Σ over live sequences of their block-table lengths (every sequence owning a private
copy of everything it references), i.e. the paper's "blocks saved by sharing / total blocks
without sharing".

Fig. 16: a translation-like workload whose prompts share a 1-shot (80-token) or 5-shot
(341-token) prefix; throughput (requests/s, tokens/s) with and without automatic prefix caching
in the same run, after an untimed warmup on a different prefix (compiles, no cache hits).

CPU scaling (documented in the JSON): demo model, lengths scaled down (`--alpaca-scale`,
`--sharegpt-scale`) and block size 8 instead of 16, so the number of blocks per sequence stays
close to the paper's at full length (Alpaca ×0.5 with bs 8 has the paper's block counts); lengths
are clipped to 3× the scaled mean so one tail request cannot dominate a CPU run. Outputs are
forced to the sampled length (ignore_eos) as in the paper.

    .venv/bin/python bench/sharing.py            # writes bench/results/<device>/sharing.{json,png}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workloads import WORKLOADS  # noqa: E402
from pagedjax import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Paper Fig. 15 (SOSP'23 §6.3): memory saving ranges over n / width ∈ {2, 4, 6}.
PAPER = {
    ("alpaca", "parallel"): (6.1, 9.8), ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "parallel"): (16.2, 30.5), ("sharegpt", "beam"): (44.3, 66.3),
}


def sample_lengths(workload: str, n: int, scale: float, seed: int) -> list[tuple[int, int]]:
    """(input, output) lengths from the workload distribution, clipped to 3x the scaled mean."""
    w = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    ins = w.input.sample(rng, n, scale)
    outs = w.output.sample(rng, n, scale)
    cap_in, cap_out = int(3 * w.input.mean * scale), int(3 * w.output.mean * scale)
    return [(int(min(i, cap_in)), int(min(o, cap_out))) for i, o in zip(ins, outs)]


def analytic_parallel_saving(lengths: list[tuple[int, int]], n: int, block_size: int) -> float:
    """Cross-check for parallel sampling: the same ratio from block arithmetic alone.

    After t generated tokens each sample holds ceil((p + t) / bs) blocks of which the p // bs
    full prompt blocks are shared by all n (assumes every request runs unstalled from admission).
    """
    used = noshare = 0
    for p, o in lengths:
        shared = p // block_size
        for t in range(1, o):
            blocks = -(-(p + t) // block_size)
            noshare += n * blocks
            used += shared + n * (blocks - shared)
    return 100.0 * (noshare - used) / max(1, noshare)


def measure_saving(llm: LLM, lengths: list[tuple[int, int]], mode: str, k: int, seed: int) -> dict:
    """Run all requests to completion, sampling block usage after every step."""
    eng = llm.engine
    bm = eng.block_manager
    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    for i, (inp, out) in enumerate(lengths):
        if mode == "parallel":
            sp = SamplingParams(n=k, temperature=1.0, seed=seed + 100 * i, max_tokens=out, ignore_eos=True)
        else:
            sp = SamplingParams(use_beam_search=True, best_of=k, n=1, temperature=0, max_tokens=out,
                                ignore_eos=True)
        eng.add_request(f"{mode}{k}-{i}", None, sp, prompt_token_ids=rng.integers(100, vocab, inp).tolist())
    used_sum = noshare_sum = steps = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        tables = [bm.get_block_table(s) for r in eng._requests.values() for s in r.group.seqs
                  if not s.status.is_finished and bm.has_blocks(s) and not bm.is_swapped(s)]
        used_sum += bm.gpu.get_num_used()
        noshare_sum += sum(len(t) for t in tables)
        steps += 1
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == eng.runner.num_gpu_blocks
    return {"mode": mode, "k": k, "steps": steps, "seconds": time.perf_counter() - t0,
            "block_steps_used": used_sum, "block_steps_without_sharing": noshare_sum,
            "saving_pct": 100.0 * (noshare_sum - used_sum) / max(1, noshare_sum)}


def prefix_throughput(llm_factory, prefix_len: int, num_requests: int, out_len: int, seed: int) -> dict:
    """Requests sharing one prefix, with and without prefix caching (warmup on another prefix)."""
    res = {}
    for caching in (False, True):
        llm = llm_factory(caching)
        vocab = llm.config.vocab_size
        rng = np.random.default_rng(seed)

        def batch(prefix: list[int], rng=rng, vocab=vocab) -> list[dict]:
            """Prefix + a short distinct 'sentence to translate' (8-23 tokens)."""
            return [{"prompt_token_ids": prefix + rng.integers(100, vocab, int(rng.integers(8, 24))).tolist()}
                    for _ in range(num_requests)]

        sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate(batch(rng.integers(100, vocab, prefix_len).tolist()), sp, use_tqdm=False)  # warmup
        reqs = batch(rng.integers(100, vocab, prefix_len).tolist())
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(r["prompt_token_ids"]) for r in reqs) + num_requests * out_len
        res["cached" if caching else "uncached"] = {
            "seconds": dt, "requests_per_s": num_requests / dt, "tokens_per_s": toks / dt,
            "num_cached_tokens": int(sum(o.num_cached_tokens for o in outs))}
    res["speedup"] = res["cached"]["requests_per_s"] / res["uncached"]["requests_per_s"]
    return res


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, wl in zip(axes[:2], ("alpaca", "sharegpt")):
        rows = result["fig15"][wl]["runs"]
        for j, mode in enumerate(("parallel", "beam")):
            ks = [r["k"] for r in rows if r["mode"] == mode]
            vals = [r["saving_pct"] for r in rows if r["mode"] == mode]
            x = np.arange(len(ks)) + (j - 0.5) * 0.38
            ax.bar(x, vals, 0.38, label=f"{mode} (ours)")
            lo, hi = PAPER[(wl, mode)]
            ax.hlines([lo, hi], x[0] - 0.2, x[-1] + 0.2, colors=f"C{j}", linestyles="dashed",
                      label=f"{mode} paper range")
        ax.set_xticks(np.arange(3), ["2", "4", "6"])
        ax.set_xlabel("n (parallel) / beam width")
        ax.set_ylabel("memory saving (%)")
        ax.set_title(f"Fig. 15 ({wl}-like)")
        ax.legend(fontsize=7)
    ax = axes[2]
    names = list(result["fig16"])
    for j, key in enumerate(("uncached", "cached")):
        ax.bar(np.arange(len(names)) + (j - 0.5) * 0.38,
               [result["fig16"][n][key]["requests_per_s"] for n in names], 0.38, label=key)
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("requests/s")
    ax.set_title("Fig. 16 shared prefix (prefix caching)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--alpaca-scale", type=float, default=0.5)
    ap.add_argument("--sharegpt-scale", type=float, default=0.2)
    ap.add_argument("--alpaca-requests", type=int, default=32)
    ap.add_argument("--sharegpt-requests", type=int, default=4)
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--prefix-out-len", type=int, default=8)
    # Large enough that no request waits on memory or sequence slots: a group stalled between
    # fork and its first write would still share its partial block and inflate the saving.
    ap.add_argument("--num-gpu-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="sharing")
    args = ap.parse_args(argv)

    import jax

    from models.loader import load_model
    from models.tokenizer import load_tokenizer

    config, params, path = load_model(args.model, None)
    tokenizer = load_tokenizer(path)

    def make(caching: bool = False, block_size: int = args.block_size) -> LLM:
        return LLM.from_params(config, params, tokenizer, block_size=block_size,
                               num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=256,
                               max_num_batched_tokens=1024, enable_prefix_caching=caching)

    device = jax.devices()[0].platform
    result: dict = {"device": device, "model": args.model, "block_size": args.block_size, "fig15": {},
                    "fig16": {}, "paper_fig15_ranges_pct": {f"{w}/{m}": v for (w, m), v in PAPER.items()}}
    llm = make()
    for wl, scale, nreq in (("alpaca", args.alpaca_scale, args.alpaca_requests),
                            ("sharegpt", args.sharegpt_scale, args.sharegpt_requests)):
        lengths = sample_lengths(wl, nreq, scale, args.seed)
        runs = []
        for mode in ("parallel", "beam"):
            for k in (2, 4, 6):
                r = measure_saving(llm, lengths, mode, k, args.seed)
                if mode == "parallel":
                    r["analytic_pct"] = analytic_parallel_saving(lengths, k, args.block_size)
                runs.append(r)
                print(f"{wl:9s} {mode:8s} k={k}: saving {r['saving_pct']:5.1f}% "
                      f"(analytic {r.get('analytic_pct', float('nan')):.1f}%) "
                      f"({r['steps']} steps, {r['seconds']:.1f}s)", flush=True)
        ins, outs = np.array(lengths).T
        result["fig15"][wl] = {
            "scale": scale, "num_requests": nreq, "source": WORKLOADS[wl].source,
            "mean_input": float(ins.mean()), "mean_output": float(outs.mean()),
            "std_input": float(ins.std()), "std_output": float(outs.std()), "runs": runs}
    for name, plen in (("1-shot (80)", 80), ("5-shot (341)", 341)):
        r = prefix_throughput(lambda c: make(c, 16), plen, args.prefix_requests, args.prefix_out_len,
                              args.seed)
        result["fig16"][name] = r
        print(f"prefix {name}: {r['uncached']['requests_per_s']:.2f} -> {r['cached']['requests_per_s']:.2f}"
              f" req/s (x{r['speedup']:.2f})", flush=True)

    print("\n| workload | mode | k | ours saving % | paper range % (k=2..6) |\n|---|---|---|---|---|")
    for wl, d in result["fig15"].items():
        for r in d["runs"]:
            lo, hi = PAPER[(wl, r["mode"])]
            print(f"| {wl} | {r['mode']} | {r['k']} | {r['saving_pct']:.1f} | {lo}–{hi} |")
    result["num_preemptions_total"] = llm.engine.get_stats().num_preemptions_total
    out = RESULTS / device
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{args.tag}.png")
    print(f"wrote {out / args.tag}.json/.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
