"""`bench/sampler.py`'s calls against the same calls at an earlier commit, interleaved.

    .venv/bin/python bench/sampler_ab.py --base COMMIT [--rows 64,256] [--reps 3]

Checks COMMIT out into a temporary git worktree and runs `bench/sampler.py --child` (one
process per run, freed heap kept as the engine keeps it) from it and from this working tree in
turn, the order alternating every rep (base, new, new, base, ...): the sampler's own time per
call, with everything XLA does around a native kernel, which a kernel-only A/B
(`bench/native_ab.py`) leaves out. Reports per call the median of the per-process medians,
with the 1-minute load average before each run; writes
bench/results/cpu/sampler_ab.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.base_tree import base_tree  # noqa: E402


def run(tree: Path, rows: str, iters: int) -> dict:
    env = {**os.environ, "PAGEDJAX_KEEP_HEAP": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(tree / "bench/sampler.py"), "--child", "--rows",
                           rows, "--iters", str(iters)], env=env, cwd=tree, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/sampler_ab.json"))
    args = ap.parse_args()
    runs = []
    with base_tree(args.base) as bt:
        base_sha, head, dirty, base = bt.base_sha, bt.head, bt.dirty, bt.path
        for rep in range(args.reps):
            order = ("base", "new") if rep % 2 == 0 else ("new", "base")
            for which in order:
                load = os.getloadavg()[0]
                r = run(base if which == "base" else ROOT, args.rows, args.iters)
                runs.append({"rep": rep, "version": which, "load_avg_1m_before": load, **r})
                print(f"rep {rep} {which} (load {load:.2f}): {r['ms']}", flush=True)
    med = {v: {b: {op: statistics.median(x["ms"][b][op] for x in runs if x["version"] == v)
                   for op in runs[0]["ms"][b]} for b in runs[0]["ms"]} for v in ("base", "new")}
    import jax

    res = {"what": "ms per call, median over reps of per-process medians (bench/sampler.py "
                   "--child), base commit against the working tree, interleaved",
           "command": "python bench/sampler_ab.py " + " ".join(sys.argv[1:]),
           "base": base_sha, "new": head + (" + working tree changes" if dirty else ""),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count()},
           "versions": {"jax": jax.__version__}, "median_ms": med, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    for b in med["new"]:
        for op in med["new"][b]:
            print(f"{b:>4} rows {op:22s} base {med['base'][b][op]:8.2f} ms   "
                  f"new {med['new'][b][op]:8.2f} ms")


if __name__ == "__main__":
    main()
