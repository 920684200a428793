"""`bench/gpu_gemv.py` at toy shapes on CPU: the harness a GPU session runs (the figures it
prints here are no claim). The chain's bytes must be every layer's weights and the head's,
and each matmul timed must be one the unrolled layers run."""

import json

from bench.gpu_gemv import main, projections
from bench.gpu_suite.seeded import SPECS


def test_rows_cover_every_projection_and_the_chain(tmp_path):
    out = tmp_path / "g.json"
    assert main(["--model", "tiny", "--rows", "1,4", "--iters", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    cfg = SPECS["tiny"].config
    shapes = projections(cfg)
    per_layer = sum(a * b for n, (a, b) in shapes.items() if n != "lm_head")
    assert res["chain_weight_bytes"] == 2 * (per_layer * cfg.num_layers
                                             + cfg.hidden_size * cfg.vocab_size)
    assert [(d["rows"], d["name"]) for d in res["dots"]] == [
        (r, n) for r in (1, 4) for n in shapes]
    assert all(d["shape"] == list(shapes[d["name"]]) and d["ms"] > 0 and d["gbps"] > 0
               for d in res["dots"])
    assert [c["rows"] for c in res["chain"]] == [1, 4]
    assert all(c["ms"] > 0 and c["pct_of_read"] > 0 for c in res["chain"])
    assert res["read_gbps"] > 0 and res["load_avg_1m_at_start"] >= 0
