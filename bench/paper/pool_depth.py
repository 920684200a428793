"""Sensitivity of Fig. 12's ShareGPT-like ratios to KV pool depth (replay clock only).

The paper's claim is about memory-bound serving. How memory-bound a run is depends on how
many max-length requests the KV pool holds (the paper's OPT-13B on an A100-40GB: about 7; our
default CPU setup: 4). This re-runs the ShareGPT-like rate sweep of ``paper_quick.json`` with
its *measured* cost model at pools of 2, 4 and 8 max-length requests, and once more with the
batch-insensitive (GPU-like, not measured) cost of :mod:`bench.paper.whatif`. Labelled replay;
no real-execution points of its own (the 4-request pool is the one validated in Fig. 12).

    .venv/bin/python -m bench.paper.pool_depth bench/results/cpu/paper/paper_quick.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.paper.replay import CostModel
from bench.paper.run import SYSTEMS, engine_kw, setup, sweep


def main(path: str, pools=(64, 128, 256)) -> None:
    src = json.load(open(path))
    measured = list(src["cost_model"]["coef_s"])
    flat = list(measured)
    flat[2] = flat[4] = 0.0
    out = {"clock": "replay; cost model from " + Path(path).name, "workload": "sharegpt", "per_pool": {}}
    for name, coef in (("measured_cost", measured), ("flat_cost_what_if", flat)):
        for nb in pools:
            cfg = setup(True, nb)
            kw = engine_kw(cfg)
            sw = sweep("sharegpt", cfg, CostModel(tuple(coef)), kw)
            rates = {s: sw["systems"][s]["sustainable_rate"] for s in SYSTEMS}
            p = rates["paged"]
            row = {"pool_tokens": nb * cfg["block_size"],
                   "max_length_requests": nb * cfg["block_size"] // cfg["max_model_len"],
                   "sustainable_rate": rates,
                   "paged_over": {s: p / r for s, r in rates.items() if r and s != "paged"}}
            out["per_pool"][f"{name}/{nb}"] = row
            print(name, nb, {s: round(v, 2) for s, v in row["paged_over"].items()}, flush=True)
    json.dump(out, open(Path(path).with_name("pool_depth.json"), "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
