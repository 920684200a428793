"""`bench/host_overhead.py` at an earlier commit against this working tree, interleaved.

    .venv/bin/python bench/host_overhead_ab.py --base COMMIT [--reps 4] [--seqs 256]
        [--kinds final_only,delta] [--mixes greedy,mixed] [--engine-arg KEY=VALUE ...]

Checks COMMIT out into a temporary git worktree, copies this tree's `bench/host_overhead.py`
into it (the same measurement on both sides), and runs it from each tree in turn, one process
per run, the order alternating every rep (base, new, new, base, ...). Before each run it waits
for a 1-minute load average under 0.45 (up to 400 s) and times a pure-Python loop: this VM
switches between speed modes ~1.5x apart within minutes, and the loop's time says which mode a
run met. Reports per configuration the median of the per-run medians; writes
bench/results/cpu/host_overhead_ab.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.base_tree import base_tree  # noqa: E402


def _quiet(limit: float = 0.45, wait_s: float = 400.0) -> float:
    """Wait for a quiet machine (bounded); the 1-minute load average when the run starts."""
    end = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < end:
        time.sleep(10)
    return os.getloadavg()[0]


def _speed_ms() -> float:
    """ms of a fixed pure-Python loop, best of 5: the host's speed mode."""
    return 1e3 * min(timeit.repeat("sum(i * i for i in range(10000))", number=100, repeat=5)) / 100


def run(tree: Path, args, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "bench/host_overhead.py"), "--seqs", args.seqs,
                    "--kinds", args.kinds, "--mixes", args.mixes, "--steps", str(args.steps),
                    "--reps", "1", "--out", str(out),
                    *(a for kv in args.engine_arg for a in ("--engine-arg", kv))],
                   env=env, cwd=tree, check=True, capture_output=True)
    return json.load(open(out))["rows"]


# Per-run figures gathered by `summarize`; the last four come with `host_overhead.py`'s
# speed probe and collector events (rows of an older script lack them).
FIELDS = ("median_ms", "p99_ms", "max_ms", "p99_speed_adjusted_ms", "gc_max_ms",
          "gc_collections")


def summarize(runs: list[dict]) -> dict:
    """Per (kind, mix, seqs) and version: each run's median, p99, slowest step, p99 at the
    host's fast speed and collections, and the median of the runs' medians."""
    out: dict = {}
    for r in runs:
        for row in r["rows"]:
            key = f"{row['output_kind']} {row['mix']} {row['num_seqs']}"
            side = out.setdefault(key, {}).setdefault(r["version"], {f: [] for f in FIELDS})
            for f in FIELDS:
                if f in row:
                    side[f].append(row[f])
    for sides in out.values():
        for side in sides.values():
            side["median_of_runs_ms"] = statistics.median(side["median_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--seqs", default="256")
    ap.add_argument("--kinds", default="final_only,delta")
    ap.add_argument("--mixes", default="greedy,mixed")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/host_overhead_ab.json"))
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to both sides' host_overhead.py, e.g. async_scheduling=true")
    args = ap.parse_args()

    runs = []
    with base_tree(args.base) as bt:
        base_sha, head, dirty, base = bt.base_sha, bt.head, bt.dirty, bt.path
        shutil.copy(ROOT / "bench/host_overhead.py", base / "bench/host_overhead.py")
        for rep in range(args.reps):
            for which in ("base", "new") if rep % 2 == 0 else ("new", "base"):
                load = _quiet()
                speed = _speed_ms()
                rows = run(base if which == "base" else ROOT, args,
                           base.parent / f"{which}_{rep}.json")
                runs.append({"rep": rep, "version": which, "load_avg_1m_before": load,
                             "python_loop_ms": speed, "rows": rows})
                print(f"rep {rep} {which:4s} load {load:.2f} loop {speed:.2f} ms: " + ", ".join(
                    f"{r['output_kind']} {r['mix']} {r['median_ms']:.2f}" for r in rows),
                    flush=True)
    summary = summarize(runs)
    res = {"what": "host ms per decode step, device stubbed (bench/host_overhead.py), a base "
                   "commit against the working tree, alternating, one process per run",
           "command": "python bench/host_overhead_ab.py " + " ".join(sys.argv[1:]),
           "base": base_sha, "new": head + (" + working tree changes" if dirty else ""),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "python": platform.python_version()},
           "summary": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    for key, sides in summary.items():
        print(f"{key}: base {sides['base']['median_of_runs_ms']:.2f} ms, "
              f"new {sides['new']['median_of_runs_ms']:.2f} ms")
        for which in ("base", "new"):
            side = sides[which]
            print(f"  {which}: p99 {_ms(side['p99_ms'])}, slowest {_ms(side['max_ms'])}, "
                  f"p99 at the fast speed {_ms(side['p99_speed_adjusted_ms'])}, collections "
                  f"{side['gc_collections']} (longest {_ms(side['gc_max_ms'])})")


def _ms(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs) + " ms"


if __name__ == "__main__":
    main()
