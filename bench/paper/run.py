"""Reproduce the paper's §6–7 comparisons on this machine: paged vs contiguous vs static.

    .venv/bin/python -m bench.paper.run --quick
    python -m bench.paper.run --preset gpu --model 13b-random      # a lent GPU (bench/gpu_suite)

1. Real execution (demo model) calibrates a per-step cost model of this engine on this device.
2. A replay clock (real scheduler + KV manager, fitted step latencies) sweeps request rates
   for every system: Fig. 12 (normalized latency), Fig. 13 (batched requests), Fig. 2
   (memory breakdown), Fig. 18b (block size).
3. Real-execution validation points per system and workload, compared with the replay of
   the identical trace (relative error stored beside each point).

Outputs ``bench/results/<device>/paper/paper[_quick].json`` and ``fig*.png``.

``--preset gpu`` is the paper's own scale (full ShareGPT/Alpaca-like lengths, 2048 context,
16-token blocks, a KV pool of 7 max-length requests as OPT-13B on an A100-40GB) for a
random-weight 13B-like model in bf16 (``--model 13b-random``; no checkpoint needs to travel).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

from bench.paper.engine_setup import build_llm
from bench.paper.figures import THRESHOLD_X
from bench.paper.metrics import FEATURES
from bench.paper.real import run_real
from bench.paper.replay import CostModel, replay
from bench.paper.trace import make_trace

SYSTEMS = ("paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max", "static")
LABELS = {"paged": "pagedjax (paged)", "contiguous-oracle": "Orca (Oracle)",
          "contiguous-pow2": "Orca (Pow2)", "contiguous-max": "Orca (Max)", "static": "Static (FT-like)"}


def engine_kw(cfg: dict) -> dict:
    """The engine / replay shape keys of a :func:`setup` config."""
    return {k: cfg[k] for k in ("num_blocks", "block_size", "max_model_len", "max_num_seqs",
                                "max_num_batched_tokens")}


def setup(quick: bool, num_blocks: int = 128) -> dict:
    return {
        "scale": 0.125,  # lengths 1/8 of the paper's means (CPU)
        "max_model_len": 256,  # 2048 / 8
        "block_size": 8,
        "num_blocks": num_blocks,  # 128 = 1024 token slots = 4 max-length requests
        "max_num_seqs": 64,
        "max_num_batched_tokens": 512,
        "replay_requests": 400 if quick else 1000,
        "real_requests": 24 if quick else 64,
        "calib_requests": 24 if quick else 64,
        "min_trace_span_s": 20.0,  # bench.paper.figures.requests_at
    }


def setup_gpu(num_blocks: int | None = None) -> dict:
    """The paper's scale on a GPU (Llama-2-13B shapes stand in for OPT-13B).

    KV pool: 7 max-length (2048-token) requests = 896 blocks of 16 tokens, 11.7 GB of bf16 KV
    for the 13B-like model (the paper: OPT-13B on an A100-40GB holds about 7). Request counts
    and the calibration / validation arrivals are sized for a 9-minute budget.
    """
    return {
        "scale": 1.0, "max_model_len": 2048, "block_size": 16,
        "num_blocks": num_blocks or 896, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
        "replay_requests": 200, "real_requests": 48, "calib_requests": 32,
        "calib_rate": 2.0,  # the finite-rate calibration run: 16 requests over ~8 s
        "real_span_s": 20.0, "real_workloads": ["sharegpt"],
        "min_trace_span_s": 20.0,  # bench.paper.figures.requests_at
    }


def sweep(workload: str, cfg: dict, cost: CostModel, kw: dict) -> dict:
    """Fig. 12: every system over request rates (x1.25 steps until all explode), replay clock."""
    from bench.paper.figures import Panel, sweep_panel  # figures imports run_real, not run

    panel = Panel(f"fig12_{workload}", workload, cfg["scale"], {s: (s, {}) for s in SYSTEMS},
                  title=f"{workload}-like")
    out = sweep_panel(panel, cfg, cost, kw, cfg["replay_requests"])
    out["rates"] = max((d["rates"] for d in out["systems"].values()), key=len)
    return out


def at_rate(workload: str, rate: float, cfg: dict, cost: CostModel, kw: dict, systems=SYSTEMS) -> dict:
    trace = make_trace(workload, cfg["replay_requests"], rate, scale=cfg["scale"],
                       max_model_len=cfg["max_model_len"])
    return {s: replay(s, trace, cost, **kw) for s in systems}


def replay_figures(result: dict, cfg: dict, cost: CostModel, kw: dict, out: Path,
                   workloads: tuple[str, ...] = ("sharegpt", "alpaca")) -> None:
    """Fig. 12/13/2/18b from the replay clock, saved after each workload."""
    for w in workloads:
        print(f"sweep {w} ...", flush=True)
        sw = sweep(w, cfg, cost, kw)
        paged_rate = sw["systems"]["paged"]["sustainable_rate"]
        result[f"fig12_{w}"] = sw
        result[f"fig13_{w}"] = {"rate": paged_rate,
                                "per_system": at_rate(w, paged_rate, cfg, cost, kw)}
        result[f"fig2_{w}"] = {"rate": 1.5 * paged_rate,
                               "per_system": at_rate(w, 1.5 * paged_rate, cfg, cost, kw)}
        result[f"fig18b_{w}"] = {
            "rate": paged_rate,
            "per_block_size": {bs: at_rate(w, paged_rate, cfg, cost, {**kw, "block_size": bs, "num_blocks":
                                                                 kw["num_blocks"] * kw["block_size"] // bs},
                                           systems=("paged",))["paged"]
                               for bs in (8, 16, 32, 64, 128, 256)}}
        json.dump(result, open(out, "w"), indent=1)


def validation_trace(cfg: dict, workload: str, n: int, rate: float):
    return make_trace(workload, n, rate, scale=cfg["scale"], max_model_len=cfg["max_model_len"], seed=7)


def calibrate(eng, cfg: dict, figs: set[str]) -> tuple[CostModel, list, dict]:
    """Warm up, then serve calibration traces for real and fit the cost model to their steps.

    Calibration traces use another seed than the validation traces; the finite-rate run covers
    the small-batch regime the validation points live in. The sampling / prefix / chatbot
    figures add runs of their own shapes (n>1 rows, cached-prefix prefills, long prompts).
    """
    tr = lambda w, n, r: validation_trace(cfg, w, n, r)  # noqa: E731
    print("warm-up ...", flush=True)
    run_real(eng, "paged", tr("sharegpt", cfg["calib_requests"], math.inf))
    run_real(eng, "static", tr("alpaca", cfg["calib_requests"], math.inf))
    n = cfg["calib_requests"]
    mk = lambda w, n, r, scale=cfg["scale"]: make_trace(  # noqa: E731
        w, n, r, scale=scale, max_model_len=cfg["max_model_len"], seed=11)
    runs = [("sharegpt", "paged", mk("sharegpt", n, math.inf), {}),
            ("sharegpt", "contiguous-max", mk("sharegpt", n, math.inf), {}),
            ("alpaca", "paged", mk("alpaca", n, math.inf), {}),
            ("sharegpt", "paged", mk("sharegpt", 16, cfg.get("calib_rate", 0.3)), {})]
    if figs & {"14", "16", "17", "19"}:
        runs += [("alpaca-x0.5-parallel4", "paged", mk("alpaca", n, math.inf, 0.5),
                  {"sampling": ("parallel", 4)}),
                 ("translation-5shot", "paged", mk("translation-5shot", n, math.inf, 0.25),
                  {"prefix_caching": True}),
                 ("chatbot", "paged", mk("chatbot", n, math.inf, 0.125), {})]
    calib, summaries = [], {}
    for w, s, trace, opts in runs:
        print(f"calibrate {w}/{s} ...", flush=True)
        summ, steps = run_real(eng, s, trace, **opts)
        calib += steps
        summaries[f"{w}/{s}@{trace[-1].arrival and len(trace) / trace[-1].arrival:.2f}"] = summ
    cost = CostModel.fit(calib)
    print("cost model", cost.coef, "step MAPE", cost.step_mape(calib), flush=True)
    return cost, calib, summaries


def core_real_points(result: dict, eng, cfg: dict, cost: CostModel, kw: dict, out: Path,
                     workloads: tuple[str, ...] = ("sharegpt", "alpaca")) -> None:
    """Fig. 12 validation: each system at 0.7x its replayed sustainable rate, served for real."""
    span = cfg.get("real_span_s", 60.0)
    for w in workloads:
        pts = {}
        for s in SYSTEMS:
            rate = 0.7 * (result[f"fig12_{w}"]["systems"][s]["sustainable_rate"] or
                          result[f"fig12_{w}"]["rates"][0])
            # Cap the arrival span (60 s on CPU) so slow baselines stay affordable.
            n_real = int(min(cfg["real_requests"], max(8, round(span * rate))))
            trace = validation_trace(cfg, w, n_real, rate)
            print(f"real {w}/{s} @ {rate:.3f} req/s ...", flush=True)
            real, _ = run_real(eng, s, trace, cost=cost)
            rep = replay(s, trace, cost, **kw)
            a, b = real["normalized_latency_s_per_token"], rep["normalized_latency_s_per_token"]
            pts[s] = {"rate": rate, "num_requests": n_real, "real": real, "replay": rep,
                      "rel_error": (b - a) / a}
            result[f"real_{w}"] = pts
            json.dump(result, open(out, "w"), indent=1)


def sharing_figures(result: dict, figs: set[str], eng, cfg: dict, cost: CostModel, kw: dict, out: Path,
                    real: bool) -> None:
    """Fig. 14/16/17 (rate sweeps per panel + real points) and Fig. 19b (block size x preemption)."""
    from bench.paper.figures import Panel, fig19b, panels, real_point, sweep_panel

    for fig, ps in panels().items():
        if fig not in figs:
            continue
        for p in ps:
            print(f"sweep {p.key} ...", flush=True)
            n = cfg["replay_requests"] // (2 if fig == "14" else 1)  # n>1 replays are slower
            sw = sweep_panel(p, cfg, cost, kw, n)
            result[p.key] = sw
            json.dump(result, open(out, "w"), indent=1)
            for s in p.real if real else ():
                rate = 0.7 * (sw["systems"][s]["sustainable_rate"] or sw["systems"][s]["rates"][0])
                print(f"real {p.key}/{s} @ {rate:.3f} req/s ...", flush=True)
                sw.setdefault("real", {})[s] = real_point(eng, p, s, rate, cfg, cost, kw)
                json.dump(result, open(out, "w"), indent=1)
    if "19" not in figs:
        return
    from bench.paper.transfer import build, measure_transfer_costs

    costs = {kw["block_size"]: cost}
    result["fig19_transfer_costs"] = {}
    for bs in (8, 16, 32, 64, 128, 256):  # per-block copy/swap costs at each block size, measured
        llm = build(bs, 256) if bs != kw["block_size"] else None
        m = measure_transfer_costs(llm if llm is not None else eng)
        result["fig19_transfer_costs"][bs] = m
        costs[bs] = cost.with_transfers(m)
        del llm
    result["cost_model"]["transfers_at_block_size"] = costs[kw["block_size"]].transfers
    rate_panel = Panel("fig19_rate", "sharegpt", cfg["scale"], {"paged": ("paged", {})})
    paged = sweep_panel(rate_panel, cfg, costs[kw["block_size"]], kw, cfg["replay_requests"])
    rate = paged["systems"]["paged"]["sustainable_rate"]
    print(f"fig19b @ {rate:.3f} req/s ...", flush=True)
    result["fig19b"] = fig19b(cfg, costs.__getitem__, kw, rate, cfg["replay_requests"])
    if real:
        fig19b_real(result, eng, cfg, costs[kw["block_size"]], kw, rate, out)
    json.dump(result, open(out, "w"), indent=1)


def fig19b_real(result: dict, eng, cfg: dict, cost: CostModel, kw: dict, rate: float, out: Path) -> None:
    """Recompute vs swap served for real at the engine's block size: at the Fig. 19b rate, and
    as a burst of 64 requests at t=0 (~3x the pool's token slots), which makes a short CPU
    trace preempt (a 24-request trace at the Fig. 19b rate fits in the pool)."""
    from bench.paper.figures import Panel, real_point

    for key, r, n in (("real", rate, None), ("real_burst", math.inf, 64)):
        for m in ("recompute", "swap"):
            p = Panel("fig19b", "sharegpt", cfg["scale"], {m: ("paged", {"preemption_mode": m})})
            print(f"{key} fig19b/{m} ...", flush=True)
            result["fig19b"].setdefault(key, {})[m] = real_point(eng, p, m, r, cfg, cost, kw, n=n)
            json.dump(result, open(out, "w"), indent=1)


def main(argv: list[str] | None = None) -> None:
    from bench.paper.engine_setup import MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized run")
    ap.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                    help="gpu: the paper's full lengths, 2048 context, 16-token blocks (setup_gpu)")
    ap.add_argument("--model", choices=MODELS, default="demo",
                    help="demo (SmolLM2 GGUF) or seeded random weights (13b-random, tiny-random)")
    ap.add_argument("--dtype", default=None, help="weights/compute dtype (random models: bfloat16)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out-dir", type=Path, default=None, help="default bench/results/<device>/paper")
    ap.add_argument("--no-real", action="store_true", help="skip validation points (debug)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV pool in blocks (cpu preset: 128 blocks of 8 tokens; gpu: 896 of 16)")
    for name in ("replay_requests", "calib_requests", "real_requests"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="override the preset")
    ap.add_argument("--calib-rate", type=float, default=None,
                    help="req/s of the finite-rate calibration run (16 requests; cpu preset 0.3)")
    ap.add_argument("--min-trace-span-s", type=float, default=None,
                    help="replayed arrivals span at least this long (more requests at high rates)")
    ap.add_argument("--figures", default="core",
                    help="'core' (Fig. 2, 12, 13, 18b) or a comma list of 14,16,17,19 (own JSON)")
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("pagedjax.engine").setLevel(logging.INFO)  # the warm-up's time
    figs = {"core"} if args.figures == "core" else set(args.figures.split(","))
    if not figs <= {"core", "14", "16", "17", "19"}:
        ap.error(f"--figures: unknown {sorted(figs - {'core', '14', '16', '17', '19'})}")
    if args.preset == "gpu":
        cfg = setup_gpu(args.num_blocks)
        tag = f"_gpu_{args.model}"
        prefix = ""
    else:
        nb = args.num_blocks or 128
        cfg = setup(args.quick, nb)
        tag = ("_quick" if args.quick else "") + (f"_pool{8 * nb}" if nb != 128 else "")
        prefix = f"pool{8 * nb}_" if nb != 128 else ""
        if args.model != "demo":
            tag += f"_{args.model}"
    for name in ("replay_requests", "calib_requests", "real_requests", "calib_rate", "min_trace_span_s"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    cfg["model"], cfg["dtype"] = args.model, args.dtype
    if "core" not in figs:
        tag += "_fig" + "-".join(sorted(figs, key=int))
    outdir = args.out_dir or Path("bench/results") / args.device / "paper"
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / f"paper{tag}.json"
    kw = engine_kw(cfg)
    t_start = time.time()
    # Printed before and after: on a GPU the build (weights drawn on the device, then the
    # warm-up's compilations) is the run's longest silent part; the first H200 run was cut at
    # its 276 s limit inside it with nothing in its log.
    print(f"building {args.model} ({args.dtype or 'default dtype'}) with warm-up ...", flush=True)
    t_build = time.time()
    eng = build_llm(**kw, model=args.model, dtype=args.dtype).engine
    build_s = time.time() - t_build
    print(f"built in {build_s:.1f} s", flush=True)
    cost, calib, calib_runs = calibrate(eng, cfg, figs)
    result = {"config": cfg, "device": args.device, "figures": sorted(figs),
              "build_s": round(build_s, 1),
              "threshold_rule": f"{THRESHOLD_X}x paged at lowest rate",
              "cost_model": {"features": list(FEATURES),
                             "coef_s": cost.coef, "num_calib_steps": len(calib),
                             "in_sample_rel_error": cost.rel_error(calib),
                             "in_sample_step_mape": cost.step_mape(calib)},
              "calibration_runs": calib_runs, "clock": "replay (fitted cost model) unless marked real"}
    if "core" in figs:
        # Each workload's real points right after its sweep: a run cut by its time limit (the
        # GPU suite's) keeps ShareGPT's validation even when the Alpaca sweep is what is cut.
        for w in ("sharegpt", "alpaca"):
            replay_figures(result, cfg, cost, kw, out, (w,))
            if not args.no_real and w in cfg.get("real_workloads", ("sharegpt", "alpaca")):
                core_real_points(result, eng, cfg, cost, kw, out, (w,))
    else:
        sharing_figures(result, figs, eng, cfg, cost, kw, out, real=not args.no_real)
    result["total_wall_s"] = time.time() - t_start
    json.dump(result, open(out, "w"), indent=1)
    from bench.paper.plots import plot_all, plot_more

    if "core" in figs:
        if not args.no_plots:
            plot_all(result, outdir, prefix)
        print(summary_text(result))
    elif not args.no_plots:
        plot_more(result, outdir, prefix)


def summary_text(result: dict) -> str:
    lines = []
    for w in ("sharegpt", "alpaca"):
        sys_ = result[f"fig12_{w}"]["systems"]
        p = sys_["paged"]["sustainable_rate"]
        for s in SYSTEMS:
            r = sys_[s]["sustainable_rate"]
            ratio = p / r if r else float("inf")
            ge = "" if sys_[s].get("bounded", True) else " (never crossed the threshold: a lower bound)"
            lines.append(f"{w:9s} {s:18s} sustainable {r:.3f} req/s  paged/x = {ratio:.2f}{ge}")
        for s, pt in result.get(f"real_{w}", {}).items():
            lines.append(f"{w:9s} {s:18s} real vs replay normalized latency err {pt['rel_error']:+.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
