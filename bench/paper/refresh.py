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
from bench.paper.run import replay_figures, summary_text, validation_trace


def main(path: str) -> None:
    p = Path(path)
    result = json.load(open(p))
    cfg = result["config"]
    cost = CostModel(tuple(result["cost_model"]["coef_s"]))
    kw = {k: cfg[k] for k in ("num_blocks", "block_size", "max_model_len", "max_num_seqs",
                              "max_num_batched_tokens")}
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
    main(sys.argv[1])
