"""Recompute the replay-clock parts of a results JSON with its stored cost model.

Used after a change to accounting only (the replay is deterministic): real-execution
summaries are kept as measured; their replay twins and errors are recomputed.

    .venv/bin/python -m bench.paper.refresh bench/results/cpu/paper/paper_quick.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.paper.plots import plot_all
from bench.paper.replay import CostModel, replay
from bench.paper.run import engine_kw, replay_figures, summary_text, validation_trace


def rerun_real(path: str, workload: str, span_s: float, max_requests: int) -> None:
    """Re-measure one workload's real points with longer traces (same rates and cost model)."""
    import math

    from bench.paper.engine_setup import build_llm
    from bench.paper.real import run_real

    p = Path(path)
    result = json.load(open(p))
    cfg = result["config"]
    cost = CostModel(tuple(result["cost_model"]["coef_s"]))
    kw = engine_kw(cfg)
    eng = build_llm(**kw).engine
    for s in ("paged", "static"):  # warm-up compiles
        run_real(eng, s, validation_trace(cfg, workload, cfg["calib_requests"], math.inf))
    for s, pt in result[f"real_{workload}"].items():
        n = int(min(max_requests, max(8, round(span_s * pt["rate"]))))
        trace = validation_trace(cfg, workload, n, pt["rate"])
        print(f"real {workload}/{s} @ {pt['rate']:.3f} req/s, {n} requests ...", flush=True)
        real, _ = run_real(eng, s, trace, cost=cost)
        rep = replay(s, trace, cost, **kw)
        a = real["normalized_latency_s_per_token"]
        pt.update(num_requests=n, real=real, replay=rep,
                  rel_error=(rep["normalized_latency_s_per_token"] - a) / a)
        json.dump(result, open(p, "w"), indent=1)
    plot_all(result, p.parent)
    print(summary_text(result))


def main(path: str) -> None:
    p = Path(path)
    result = json.load(open(p))
    cfg = result["config"]
    cost = CostModel(tuple(result["cost_model"]["coef_s"]))
    kw = engine_kw(cfg)
    replay_figures(result, cfg, cost, kw, p)
    for w in ("sharegpt", "alpaca"):
        for s, pt in result.get(f"real_{w}", {}).items():
            pt["replay"] = replay(s, validation_trace(cfg, w, pt["num_requests"], pt["rate"]), cost, **kw)
            a = pt["real"]["normalized_latency_s_per_token"]
            pt["rel_error"] = (pt["replay"]["normalized_latency_s_per_token"] - a) / a
    json.dump(result, open(p, "w"), indent=1)
    plot_all(result, p.parent, p.stem.removeprefix("paper_quick").strip("_") and f"{p.stem}_")
    print(summary_text(result))


if __name__ == "__main__":
    if len(sys.argv) > 2:  # PATH WORKLOAD SPAN_S MAX_REQUESTS
        rerun_real(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        main(sys.argv[1])
