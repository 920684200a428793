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

``--lockstep``: the two versions run at the same time instead, one process each, and this
script referees their timed steps in turns of ``--turn`` steps (base, new, new, base, ...),
each process waiting on a pipe while the other steps (`host_overhead.py --baton`). A speed mode of
the host then lands on both sides' steps alike, within milliseconds, and each step of one
side has a neighbour of the other: the summary adds the median of the paired per-step
ratios new / base. (Run by run, this VM's modes moved a side's median up to 2x between
neighbouring runs.)
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


def run_lockstep(trees: dict[str, Path], args, outdir: Path, rep: int, first: str
                 ) -> dict[str, tuple[list[dict], list[dict]]]:
    """Both versions at once, their timed steps refereed in turns of ``args.turn`` steps
    (``first`` takes the even turns first); per version, its rows and its per-step traces."""
    n_configs = len(args.kinds.split(",")) * len(args.mixes.split(",")) * len(
        args.seqs.split(","))
    sides: dict[str, dict] = {}
    try:
        for which, tree in trees.items():
            go_r, go_w = os.pipe()  # referee -> process: step
            done_r, done_w = os.pipe()  # process -> referee: ready / stepped
            out, trace = outdir / f"{which}_{rep}.json", outdir / f"{which}_{rep}_trace.json"
            err = open(outdir / f"{which}_{rep}.err", "w")
            proc = subprocess.Popen(
                [sys.executable, str(tree / "bench/host_overhead.py"), "--seqs", args.seqs,
                 "--kinds", args.kinds, "--mixes", args.mixes, "--steps", str(args.steps),
                 "--reps", "1", "--out", str(out), "--trace", str(trace),
                 "--baton", f"{go_r},{done_w}",
                 *(a for kv in args.engine_arg for a in ("--engine-arg", kv))],
                env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, pass_fds=(go_r, done_w),
                stdout=subprocess.DEVNULL, stderr=err,
                # Both on one CPU: a vCPU of this VM can run slower than the other.
                preexec_fn=lambda: os.sched_setaffinity(0, {args.cpu}))
            os.close(go_r)
            os.close(done_w)
            sides[which] = {"proc": proc, "go": go_w, "done": done_r, "out": out,
                            "trace": trace, "err": err}
        order = [first, next(w for w in trees if w != first)]

        def expect(which: str, want: bytes) -> None:
            got = os.read(sides[which]["done"], 1)
            if got != want:
                raise RuntimeError(f"{which}: {got!r} instead of {want!r} (see "
                                   f"{sides[which]['err'].name})")

        for _ in range(n_configs):
            for which in order:
                expect(which, b"r")
            for k, at in enumerate(range(0, args.steps, args.turn)):
                for which in order if k % 2 == 0 else order[::-1]:
                    for _ in range(min(args.turn, args.steps - at)):
                        os.write(sides[which]["go"], b"g")
                        expect(which, b"d")
        for which, side in sides.items():
            if side["proc"].wait(timeout=600) != 0:
                raise RuntimeError(f"{which} failed (see {side['err'].name})")
    finally:
        for side in sides.values():
            if side["proc"].poll() is None:
                side["proc"].kill()
            os.close(side["go"])
            os.close(side["done"])
            side["err"].close()
    return {which: (json.load(open(side["out"]))["rows"], json.load(open(side["trace"])))
            for which, side in sides.items()}


def paired_ratios(base_trace: list[dict], new_trace: list[dict]) -> dict[str, float]:
    """Per configuration: the median over timed steps of new / base, step k of one side
    against step k of the other (neighbours in time under `--lockstep`)."""
    out = {}
    for b, n in zip(base_trace, new_trace, strict=True):
        key = f"{b['output_kind']} {b['mix']} {b['num_seqs']}"
        ratios = [tn / tb for (tb, _), (tn, _) in zip(b["step_ms_and_probe_us"],
                                                     n["step_ms_and_probe_us"], strict=True)]
        out[key] = statistics.median(ratios)
    return out


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
    ap.add_argument("--lockstep", action="store_true",
                    help="run both versions at once, their timed steps in turn (see above)")
    ap.add_argument("--cpu", type=int, default=0,
                    help="--lockstep: the CPU both versions are pinned to")
    ap.add_argument("--turn", type=int, default=10,
                    help="--lockstep: steps per turn (one step per turn left each step's "
                         "caches to the other process: 256-sequence steps ran ~2x slower)")
    args = ap.parse_args()

    runs = []
    paired: dict[str, list[float]] = {}
    with base_tree(args.base) as bt:
        base_sha, head, dirty, base = bt.base_sha, bt.head, bt.dirty, bt.path
        shutil.copy(ROOT / "bench/host_overhead.py", base / "bench/host_overhead.py")
        for rep in range(args.lockstep and args.reps):
            load = _quiet()
            speed = _speed_ms()
            first = "base" if rep % 2 == 0 else "new"
            got = run_lockstep({"base": base, "new": ROOT}, args, base.parent, rep, first)
            for which, (rows, _) in got.items():
                runs.append({"rep": rep, "version": which, "load_avg_1m_before": load,
                             "python_loop_ms": speed, "first": first, "rows": rows})
            for key, r in paired_ratios(got["base"][1], got["new"][1]).items():
                paired.setdefault(key, []).append(r)
            print(f"rep {rep} lockstep load {load:.2f} loop {speed:.2f} ms: " + ", ".join(
                f"{b['output_kind']} {b['mix']} {b['num_seqs']} base {b['median_ms']:.2f} new "
                f"{n['median_ms']:.2f}" for b, n in zip(got["base"][0], got["new"][0],
                                                         strict=True)), flush=True)
        for rep in range(0 if args.lockstep else args.reps):
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
    for key, ratios in paired.items():
        summary[key]["paired_step_ratio_new_over_base"] = ratios
    res = {"what": "host ms per decode step, device stubbed (bench/host_overhead.py), a base "
                   "commit against the working tree, " + (
                       "both at once, their timed steps in turn (--lockstep)" if args.lockstep
                       else "alternating, one process per run"),
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
              f"new {sides['new']['median_of_runs_ms']:.2f} ms" + (
                  f", paired step ratios new / base "
                  f"{' / '.join(f'{r:.3f}' for r in sides['paired_step_ratio_new_over_base'])}"
                  if "paired_step_ratio_new_over_base" in sides else ""))
        for which in ("base", "new"):
            side = sides[which]
            print(f"  {which}: p99 {_ms(side['p99_ms'])}, slowest {_ms(side['max_ms'])}, "
                  f"p99 at the fast speed {_ms(side['p99_speed_adjusted_ms'])}, collections "
                  f"{side['gc_collections']} (longest {_ms(side['gc_max_ms'])})")


def _ms(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs) + " ms"


if __name__ == "__main__":
    main()
