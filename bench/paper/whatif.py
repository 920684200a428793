"""What-if (not a measurement): the same replay with a batch-insensitive step cost.

The paper's GPUs run a decode step in nearly the same time for 1 or ~64 sequences, so
throughput tracks how many requests fit in KV memory. On this CPU each extra padded row
costs time (see the cost model), which caps what a bigger batch buys. This script keeps the
measured intercepts and prefill cost of ``paper_quick.json``'s cost model, sets the per-row
and per-KV-token costs to zero, and re-runs the rate sweep, to show how much of the gap
between our CPU numbers and the paper's is the device's cost curve rather than memory
management. Output: ``paper_quick_whatif_flat.json`` and ``whatif_flat_fig12_normalized_latency.png``.

    .venv/bin/python -m bench.paper.whatif bench/results/cpu/paper/paper_quick.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.paper.plots import _fig12
from bench.paper.replay import CostModel
from bench.paper.run import SYSTEMS, engine_kw, sweep


def main_more(path: str) -> None:
    """The same what-if for a ``--figures 14,16,17,19`` JSON (Fig. 14/16/17 panels)."""
    from bench.paper.figures import panels, sweep_panel
    from bench.paper.plots import plot_more

    src = json.load(open(path))
    cfg = src["config"]
    c = list(src["cost_model"]["coef_s"])
    c[2] = c[4] = 0.0
    transfers = src["cost_model"].get("transfers_at_block_size", {})
    cost = CostModel(tuple(c), {k: tuple(v) for k, v in transfers.items()})
    kw = engine_kw(cfg)
    out = {"what_if": "batch-insensitive step cost (GPU-like); NOT a measurement",
           "cost_model": {"features": src["cost_model"]["features"], "coef_s": c}, "config": cfg}
    for fig, ps in panels().items():
        for p in ps:
            if p.key not in src:
                continue
            print(f"what-if sweep {p.key} ...", flush=True)
            out[p.key] = sweep_panel(p, cfg, cost, kw, cfg["replay_requests"] // (2 if fig == "14" else 1))
            print({s: round(v, 2) for s, v in out[p.key]["ratio_first_over"].items()}, flush=True)
    dst = Path(path).with_name(Path(path).stem + "_whatif_flat.json")
    json.dump(out, open(dst, "w"), indent=1)
    plot_more(out, dst.parent, "whatif_flat_",
              note="WHAT-IF replay, batch-insensitive step cost: not a measurement")


def main(path: str) -> None:
    src = json.load(open(path))
    if "fig12_sharegpt" not in src:
        main_more(path)
        return
    cfg = src["config"]
    c = list(src["cost_model"]["coef_s"])
    c[2] = c[4] = 0.0  # rows_padded, kv_tokens: a step costs the same at any batch size
    cost = CostModel(tuple(c))
    kw = engine_kw(cfg)
    out = {"what_if": "batch-insensitive step cost (GPU-like); NOT a measurement",
           "cost_model": {"features": src["cost_model"]["features"], "coef_s": c}, "config": cfg}
    for w in ("sharegpt", "alpaca"):
        print(f"what-if sweep {w} ...", flush=True)
        out[f"fig12_{w}"] = sweep(w, cfg, cost, kw)
        sw = out[f"fig12_{w}"]["systems"]
        p = sw["paged"]["sustainable_rate"]
        for s in SYSTEMS:
            r = sw[s]["sustainable_rate"]
            print(f"{w:9s} {s:18s} {r:.3f} req/s  paged/x {p / r if r else float('inf'):.2f}")
    dst = Path(path).with_name("paper_quick_whatif_flat.json")
    json.dump(out, open(dst, "w"), indent=1)
    _fig12(out, dst.parent, "whatif_flat_")


if __name__ == "__main__":
    main(sys.argv[1])
