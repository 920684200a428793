"""Re-run a result's replay figures (Fig. 2, 12, 13, 18b) from its recorded cost model.

The replay clock is host-only: the real scheduler and KV managers stepped with the cost model
fitted on the device. So when the replay code changes (as when finite traces were found to hide
overload, :data:`bench.paper.figures.MIN_TRACE_SPAN_S`), a GPU run's sweeps can be redone on
any machine from its JSON, without device time. The real validation points and the
calibration are kept as measured; the output says it is a re-sweep and of what.

    .venv/bin/python -m bench.paper.resweep \\
        bench/results/nvidia_h200/gpu_suite/paper_gpu_13b-random.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from bench.paper.replay import CostModel
from bench.paper.run import engine_kw, replay_figures, summary_text

REPLAY_KEYS = ("fig12", "fig13", "fig2", "fig18b")


def resweep(src: dict, min_trace_span_s: float | None, out: Path) -> dict:
    cfg = dict(src["config"])
    if min_trace_span_s is not None:
        cfg["min_trace_span_s"] = min_trace_span_s
    transfers = src["cost_model"].get("transfers_at_block_size", {})
    cost = CostModel(tuple(src["cost_model"]["coef_s"]), {k: tuple(v) for k, v in transfers.items()})
    result = {k: v for k, v in src.items() if not k.startswith(tuple(f"{f}_" for f in REPLAY_KEYS))}
    result["config"] = cfg
    result["resweep"] = {
        "what": "Fig. 2/12/13/18b replayed again from this file's cost model with the current "
                "replay code; the calibration and the real points (each with the replay of its "
                "own trace) are the device run's",
        "date": datetime.date.today().isoformat(),
        "previous_sustainable_rate": {
            w: {s: d["sustainable_rate"] for s, d in src[f"fig12_{w}"]["systems"].items()}
            for w in ("sharegpt", "alpaca") if f"fig12_{w}" in src},
    }
    replay_figures(result, cfg, cost, engine_kw(cfg), out)
    json.dump(result, open(out, "w"), indent=1)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: <path stem>_resweep.json")
    ap.add_argument("--min-trace-span-s", type=float, default=None,
                    help="override the config's (default: bench.paper.figures.MIN_TRACE_SPAN_S)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    out = args.out or args.path.with_name(args.path.stem + "_resweep.json")
    result = resweep(json.load(open(args.path)), args.min_trace_span_s, out)
    if not args.no_plots:
        from bench.paper.plots import plot_all

        plot_all(result, out.parent, out.stem.removeprefix("paper_") + "_")
    print(summary_text(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
