"""Fig. 19a (Kwon et al., SOSP'23 §7.3): overhead of swapping vs recomputation per block size.

Per block size, the demo-model engine (SmolLM2-135M, fp32, preemption_mode="swap") gets a KV pool
of POOL_TOKENS slots. For a preempted N-token sequence we time (median of --repeats, each shape
warmed up) runner.swap_out / swap_in of its ceil(N / block_size) blocks (synced after swap_in), and
recompute = one engine.step() prefilling an N-token random prompt (max_tokens=1, so scheduling and
sampling are included).

On this CPU-only machine "device" and "host" are the same RAM: swap measures the engine's
gather/scatter + host-pool copy path, not PCIe. The paper's small-block penalty comes from one
cudaMemcpy per block; this runner does one batched gather (out) / scatter (in) per cache for all
blocks, so the call count does not grow as blocks shrink, only the copy granularity (layers *
kv_heads runs of block_size * head_dim elements per block); large blocks also round N up. Expect
no strong small-block penalty. Recompute is not flat here: the CPU (XLA) attention gathers every
padded block-table slot (>= 4 blocks, capped by max_model_len), i.e. attn_context_tokens
(recorded), which grows with block size. CPU compute is slow and copies cheap, so swapping wins
by orders of magnitude, unlike on the paper's GPU.

measure_transfer_costs(engine) fits time = fixed + per_block * num_blocks for copy_blocks
(copy-on-write), swap_out and swap_in at the engine's block size, for the replay cost model.
Temporaries of tens of MB (big blocks, many blocks) are either reused heap or fresh page-faulting
memory depending on the process's history, so those costs can differ ~4x between runs.
Run: python -m bench.paper.transfer [--block-sizes 8 16 ...] [--tokens 64 256] [--repeats 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from itertools import count

import jax
import numpy as np

POOL_TOKENS = 4096  # KV slots, identical for every block size (num_blocks = POOL_TOKENS // bs)


def _runs_s(fn, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of ``repeats`` calls of fn after ``warmup`` untimed ones (compiles the shape)."""
    times = []
    for _ in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def _sync(runner) -> None:
    jax.block_until_ready((runner.k_cache, runner.v_cache))


def swap_runs(runner, n: int, repeats: int = 10) -> tuple[list[float], list[float]]:
    """Seconds of swap_out and of swap_in (synced) of blocks 0..n-1 <-> host blocks 0..n-1."""
    pairs = [(i, i) for i in range(n)]
    _sync(runner)
    out = _runs_s(lambda: runner.swap_out(pairs), repeats)
    return out, _runs_s(lambda: (runner.swap_in(pairs), _sync(runner)), repeats)


def copy_runs(runner, n: int, repeats: int = 10) -> list[float]:
    """Seconds of copy_blocks of n pairs (i -> n + i), synced."""
    pairs = [(i, n + i) for i in range(n)]
    return _runs_s(lambda: (runner.copy_blocks(pairs), _sync(runner)), repeats)


def _fit(counts: list[int], secs: list[float]) -> tuple[float, float]:
    """secs ~ a + b * counts -> (a, b), least squares on relative error (so the few-block points
    the engine mostly issues count as much as the big ones); a < 0 refits through the origin."""
    n, t = np.asarray(counts, float), np.asarray(secs, float)
    if len(n) >= 2:
        b, a = np.polyfit(n, t, 1, w=1 / t)
        if a >= 0:
            return float(a), float(b)
    return 0.0, float(np.sum(n / t) / np.sum(n * n / t ** 2))  # min sum((t - b n) / t)^2


def measure_transfer_costs(llm_engine, repeats: int = 10, max_blocks: int = 64,
                           max_tokens: int = 1024) -> dict:
    """Fixed (per call) and per-block seconds of copy_blocks, swap_out and swap_in at the engine's
    block size, fitted over 1, 2, 4, ... blocks (<= max_blocks, max_tokens, half the pool). Takes an
    idle ``LLM`` or ``LLMEngine`` (copies overwrite blocks). copy_blocks pads to a power-of-two
    bucket >= 8 pairs (padding still gathers block 0), so 1..8 pairs cost the same."""
    if (engine := getattr(llm_engine, "engine", llm_engine)).has_unfinished_requests():
        raise RuntimeError("measure_transfer_costs needs an idle engine")
    runner = engine.runner
    cap = min(max_blocks, max(1, max_tokens // runner.block_size), runner.num_gpu_blocks // 2,
              runner.num_cpu_blocks)
    counts = [c for c in (2 ** k for k in range(8)) if c <= cap]
    swaps = [[statistics.median(r) for r in swap_runs(runner, c, repeats)] for c in counts]
    res = {"block_size": runner.block_size, "block_counts": counts}
    for name, secs in (("copy", [statistics.median(copy_runs(runner, c, repeats)) for c in counts]),
                       ("swap_out", [s[0] for s in swaps]), ("swap_in", [s[1] for s in swaps])):
        a, b = _fit(counts, secs)
        res |= {f"{name}_s_per_block": b, f"{name}_s_fixed": a, f"{name}_s_raw": secs}
    return res


def recompute_runs(engine, n_tokens: int, repeats: int, rng: np.random.Generator) -> list[float]:
    """Seconds of the engine step that prefills an n-token random prompt (one new token)."""
    from pagedjax.sampling_params import SamplingParams

    sp, ids, vocab = SamplingParams(temperature=0, max_tokens=1), count(), engine.model_config.vocab_size

    def once():
        engine.add_request(f"rc{next(ids)}", rng.integers(0, vocab, n_tokens).tolist(), sp)
        outs = engine.step()
        assert outs and outs[0].finished and not engine.has_unfinished_requests()

    return _runs_s(once, repeats)


def build(block_size: int, max_tokens: int):
    from bench.paper.engine_setup import demo_model
    from pagedjax import LLM

    m = 2 * max_tokens
    return LLM.from_params(*demo_model(), num_gpu_blocks=POOL_TOKENS // block_size, block_size=block_size,
                           max_model_len=m, max_num_seqs=4, max_num_batched_tokens=m,
                           preemption_mode="swap", swap_space_gb=0.5)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_n := result["per_tokens"]), figsize=(5 * len(per_n), 3.6))
    for ax, (n, d) in zip(np.atleast_1d(axes), per_n.items()):
        bss = sorted(d, key=int)
        for key, label in (("swap_in_ms", "swap in"), ("swap_out_ms", "swap out"),
                           ("swap_ms", "swap in + out"), ("recompute_ms", "recompute")):
            ax.plot([int(b) for b in bss], [d[b][key] for b in bss], marker="o", label=label)
        ax.set(yscale="log", xlabel="block size (tokens)", ylabel="latency (ms)",
               title=f"N = {n} tokens ({result['device']}, medians)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def point(engine, n: int, repeats: int, recompute_repeats: int, rng) -> dict:
    """Fig. 19a at one (block size, N): medians (ms), minima, every run, load average."""
    from pagedjax.worker.step_inputs import bucket

    runner, med, ms = engine.runner, statistics.median, lambda xs: [round(1e3 * x, 3) for x in xs]
    k = math.ceil(n / runner.block_size)
    out_s, in_s = swap_runs(runner, k, repeats)
    both = [o + i for o, i in zip(out_s, in_s)]
    rec = recompute_runs(engine, n, recompute_repeats, rng)
    m_pad = min(bucket(k, 4), max(runner.max_blocks_per_seq, k))  # as step_inputs pads block tables
    return {"num_blocks": k, "swap_out_ms": 1e3 * med(out_s), "swap_in_ms": 1e3 * med(in_s),
            "swap_ms": 1e3 * med(both), "recompute_ms": 1e3 * med(rec), "swap_min_ms": 1e3 * min(both),
            "recompute_min_ms": 1e3 * min(rec), "attn_context_tokens": m_pad * runner.block_size,
            "loadavg_1m": os.getloadavg()[0], "runs_ms": {"swap_out": ms(out_s), "swap_in": ms(in_s),
                                                          "recompute": ms(rec)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--block-sizes", [8, 16, 32, 64, 128, 256]), ("--tokens", [64, 256])):
        ap.add_argument(flag, type=int, nargs="+", default=default)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--recompute-repeats", type=int, default=10)
    args = ap.parse_args()
    from bench.results_dir import RESULTS, device_tag

    rng, per_n, costs = np.random.default_rng(0), {str(n): {} for n in args.tokens}, {}
    for bs in args.block_sizes:
        llm = build(bs, max(args.tokens))
        for n in args.tokens:
            d = per_n[str(n)][str(bs)] = point(llm.engine, n, args.repeats, args.recompute_repeats, rng)
            print(f"bs={bs:3d} N={n}: swap out {d['swap_out_ms']:.2f} in {d['swap_in_ms']:.2f} "
                  f"ms, recompute {d['recompute_ms']:.0f} ms", flush=True)
        costs[str(bs)] = measure_transfer_costs(llm.engine, args.repeats)
        del llm
    result = {
        "figure": "fig19a: swap vs recompute overhead per block size (Kwon et al. SOSP'23 §7.3)",
        "config": {"model": "SmolLM2-135M (demo, fp32)", "pool_tokens": POOL_TOKENS, "statistic": "median",
                   "max_model_len": 2 * max(args.tokens), **vars(args),
                   "swap": "runner.swap_out / swap_in of ceil(N/bs) blocks (swap_in synced)",
                   "recompute": "engine.step() prefilling an N-token random prompt, max_tokens=1"},
        "device": "{0.platform}:{0.device_kind}".format(jax.devices()[0]), "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "per_tokens": per_n, "transfer_costs": costs}
    out = RESULTS / device_tag() / "paper"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fig19a_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "fig19a_overhead.png")
    print(f"wrote {out}/fig19a_overhead.{{json,png}}")


if __name__ == "__main__":
    main()
