"""Write the CPU goldens the GPU suite's ``e2e`` stage checks against.

    .venv/bin/python tools/make_gpu_goldens.py [demo] [llama3_8b_2l]

For each seeded model (``bench/gpu_suite/seeded.py``): the golden record in fp32 with the XLA
attention path and no engine features (``bench/gpu_suite/goldens.py: compute_golden``), then
the GPU plan itself run here on CPU twice to calibrate what "agrees" means:

* fp32 with every feature on vs the golden: the engine's own fp32 deviation (reduction order of
  chunked vs whole prefills). ``tolerance.float32`` = max(2e-3, 10x that).
* bf16 vs the golden: what bf16 costs on a correct engine. ``tolerance.bfloat16`` =
  max(0.1, 3x the largest top-8 logprob deviation seen), ``tie_margin.bfloat16`` = half of it.

Both measurements are stored beside the tolerances (``cpu_calibration``), and the plan's
checks are re-run with the final tolerances, which must pass here before a GPU is asked to.
Takes ~5 min and ~12 GB for the Llama-3-8B two-layer model on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_suite import goldens as G  # noqa: E402
from bench.gpu_suite.seeded import SPECS, seeded_params  # noqa: E402


def _ceil2(x: float) -> float:
    """Round up to two significant digits."""
    if x <= 0:
        return x
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10**e) * 10**e


def _calibration(res: dict) -> dict:
    s = res["score"]
    return {"max_abs_diff": s["max_abs_diff"], "top1_raw": s["top1_raw"],
            "top1_decisive": s["top1_decisive"], "flip_margins": s["flip_margins"],
            "greedy_tokens_matched": [res[k]["tokens_matched"] for k in ("greedy_recompute", "greedy_swap")],
            "greedy_tokens": res["greedy_recompute"]["tokens"],
            "beam_abs_diff": [b["abs_diff"] for b in res["beam"]["beams"]],
            "features": {k: res[k]["features"] for k in G.PLAN_RUNS}, "wall_s": res["wall_s"]}


def make(name: str) -> dict:
    import jax
    import jax.numpy as jnp

    spec = SPECS[name]
    t0 = time.time()
    params = seeded_params(spec.config, spec.seed)
    print(f"{name}: weights in {time.time() - t0:.1f} s", flush=True)
    golden = G.compute_golden(spec, params)
    print(f"{name}: golden in {time.time() - t0:.1f} s", flush=True)

    f32 = G.run_plan(spec, params, golden, "float32", "xla", keep_raw=True)
    golden["tolerance"]["float32"] = max(G.TOL_FP32, _ceil2(10 * f32["score"]["max_abs_diff"]))
    print(f"{name}: fp32 plan max diff {f32['score']['max_abs_diff']:.2e} ({time.time() - t0:.1f} s)",
          flush=True)

    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    del params
    golden["tolerance"]["bfloat16"] = 1e9  # measure first, calibrate below
    b16 = G.run_plan(spec, p16, golden, "bfloat16", "xla", keep_raw=True)
    tol16 = max(G.TOL_BF16_MIN, _ceil2(3 * b16["score"]["max_abs_diff"]))
    golden["tolerance"]["bfloat16"] = tol16
    golden["tie_margin"]["bfloat16"] = tol16 / 2
    print(f"{name}: bf16 plan max diff {b16['score']['max_abs_diff']:.3f} -> tol {tol16} "
          f"({time.time() - t0:.1f} s)", flush=True)

    golden["cpu_calibration"] = {}
    for dtype, res in (("float32", f32), ("bfloat16", b16)):
        checks = G.recompare(golden, res["raw"], dtype)
        cal = _calibration(res)
        cal["recheck_ok"] = {k: v["ok"] for k, v in checks.items()}
        golden["cpu_calibration"][dtype] = cal
        if not all(cal["recheck_ok"].values()):
            raise SystemExit(f"{name} {dtype}: CPU plan fails its own tolerances: {cal['recheck_ok']}")
    golden["made_with"]["wall_s"] = round(time.time() - t0, 1)
    return golden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(G.GOLDEN_MODELS), choices=list(G.GOLDEN_MODELS))
    args = ap.parse_args()
    G.GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        golden = make(name)
        # One line per top-level key: small, and a re-made file diffs key by key.
        body = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                           for k, v in golden.items())
        G.golden_path(name).write_text("{\n" + body + "\n}\n")
        size = G.golden_path(name).stat().st_size
        print(f"wrote {G.golden_path(name)} ({size / 1024:.0f} KiB)", flush=True)


if __name__ == "__main__":
    main()
