"""``python -m bench.gpu_suite --stage kernels|bench|e2e|paper|all [--dry-run] [--out DIR]``.

``--stage`` also takes a comma list (``kernels,bench`` fits one 10-minute device call). Each
stage runs in a child process of its own, so it starts with the whole GPU (JAX and the pytest /
paper subprocesses would otherwise share one device memory pool) and can be killed at a hard
limit without losing the others; the child gets ``--budget-s`` seconds (default: its entry in
``BUDGET_S``, sized for an H100) and stops starting new work when they run out.
``--dry-run`` runs every stage at toy shapes on CPU in well under two minutes (CI runs it:
tests/bench/test_gpu_suite_dry_run.py). Exit status: 0 when no summary row says FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

STAGES = ("kernels", "bench", "e2e", "paper")
# Seconds per stage on an H100: kernels + bench share one 10-minute call (docs/gpu.md).
BUDGET_S = {"kernels": 180, "bench": 240, "e2e": 480, "paper": 480}
# Caps for --dry-run: the work is tiny (e2e takes ~40 s on a quiet 2-core host), but a CI worker
# shares its cores with another, and at 90 s the e2e stage once ran out before its bf16 half;
# at 240 s, with four processes on the two cores, it ran out before its last A/B (stop 54).
# A dry run's budget drops no part (`Budget.complete`); past its cap a stage is stopped.
DRY_BUDGET_S = {"kernels": 240, "bench": 300, "e2e": 480, "paper": 240}
HARD_LIMIT_GRACE_S = 30  # past its budget a child is killed; its JSON so far stays


def parse_stages(text: str) -> list[str]:
    names = STAGES if text == "all" else tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in STAGES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {bad}; expected {'|'.join(STAGES)}|all")
    return list(names)


def child_env(dry_run: bool) -> dict[str, str]:
    from bench.gpu_suite.common import REPO

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # Allocate on demand: the kernels stage's pytest and the paper stage's engine are
    # processes of their own beside the stage process.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if dry_run:  # CPU even where a GPU is visible: the dry run checks the harness only
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_stage_in_process(stage: str, out: Path, seconds: float, dry_run: bool) -> int:
    """One stage in this process (what each child runs)."""
    from bench.gpu_suite import stage_bench, stage_e2e, stage_kernels, stage_paper
    from bench.gpu_suite.common import Budget, device_meta
    from bench.results_dir import device_tag

    runners = {"kernels": stage_kernels.run, "bench": stage_bench.run, "e2e": stage_e2e.run,
               "paper": stage_paper.run}
    meta = {**device_meta(), "device_tag": device_tag(), "dry_run": dry_run, "budget_s": seconds}
    print(f"# stage {stage} on {meta['device']}: budget {seconds:.0f} s", flush=True)
    budget = Budget(seconds, reserve=min(30.0, 0.08 * seconds), complete=dry_run)
    rec = runners[stage](out, budget, dry_run, meta)
    return 1 if any(r["verdict"] == "FAIL" for r in rec.data["summary"]) else 0


def run_stage_child(stage: str, out: Path, seconds: float, dry_run: bool) -> dict:
    """A stage in a child process under a hard limit; its JSON record (or a crash record)."""
    cmd = [sys.executable, "-m", "bench.gpu_suite", "--in-process", "--stage", stage, "--out", str(out),
           "--budget-s", str(seconds), *(["--dry-run"] if dry_run else [])]
    t0 = time.monotonic()
    killed = False
    try:
        rc = subprocess.run(cmd, env=child_env(dry_run), timeout=seconds + HARD_LIMIT_GRACE_S).returncode
    except subprocess.TimeoutExpired:
        rc, killed = None, True
    path = out / f"{stage}.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"stage": stage, "status": "no record", "summary": []}
    if rec.get("status") == "running" or killed or (rc not in (0, 1)):
        why = "killed at the hard limit" if killed else f"exit status {rc}"
        rec.setdefault("summary", []).append({"item": "stage process", "result": why, "verdict": "FAIL"})
        rec["status"] = f"incomplete ({why})"
    rec["elapsed_s"] = time.monotonic() - t0
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=parse_stages, default=list(STAGES),
                    help="kernels | bench | e2e | paper | all, or a comma list")
    ap.add_argument("--dry-run", action="store_true", help="toy shapes on CPU: checks the harness")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default $OUT, else bench/results/<device>/gpu_suite)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds per stage (overrides)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the (single) stage in this process; children are started this way")
    args = ap.parse_args(argv)
    from bench.gpu_suite.common import default_out_dir, summary_table

    if args.in_process:
        if len(args.stage) != 1:
            ap.error("--in-process runs exactly one stage")
        out = args.out or default_out_dir()
        out.mkdir(parents=True, exist_ok=True)
        seconds = args.budget_s or (DRY_BUDGET_S if args.dry_run else BUDGET_S)[args.stage[0]]
        try:
            return run_stage_in_process(args.stage[0], out, seconds, args.dry_run)
        except Exception:
            traceback.print_exc()
            return 2

    if args.out is None and not os.environ.get("OUT"):
        # The default folder names the device, which needs JAX: ask a child, not this process.
        probe = subprocess.run([sys.executable, "-c", "from bench.gpu_suite.common import default_out_dir;"
                                "print(default_out_dir())"], env=child_env(args.dry_run),
                               capture_output=True, text=True, check=True)
        out = Path(probe.stdout.strip().splitlines()[-1])
    else:
        out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    print(f"# gpu_suite: stages {','.join(args.stage)}, dry_run={args.dry_run}, out {out}", flush=True)
    records = []
    for stage in args.stage:
        seconds = args.budget_s or (DRY_BUDGET_S if args.dry_run else BUDGET_S)[stage]
        records.append(run_stage_child(stage, out, seconds, args.dry_run))
        print(f"# stage {stage}: {records[-1].get('status')} in {records[-1]['elapsed_s']:.0f} s", flush=True)
    print()
    print(summary_table(records))
    failed = any(r["verdict"] == "FAIL" for rec in records for r in rec.get("summary", ()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
