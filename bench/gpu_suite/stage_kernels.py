"""Stage ``kernels``: the kernel test suite, non-interpreted, on the GPU.

On a GPU ``pallas_kernels.backend.interpret_mode()`` is False, so every ``backend="pallas"``
test case compiles and runs the real Triton kernels (on CPU CI the same tests interpret them).
pytest runs as a subprocess with a hard timeout; its ``-v`` log is written to the out dir as it
runs and parsed for counts, so a timeout still reports how far it got. Skips are reported,
never counted as passes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_suite.common import REPO, Budget, Recorder

CPU_ONLY_FILES = ("test_cpu_native.py", "test_dense_matmul.py", "test_greedy_rows.py",
                  "test_packed_matmul.py", "test_sample_rows.py")
_LINE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# pytest-xdist's -v lines put the outcome first: "[gw1] [ 12%] PASSED tests/...::test[x]".
_XDIST_LINE = re.compile(r"^\[gw\d+\]\s+\[\s*\d+%\]\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+"
                         r"(tests/\S+::\S+)")
# The first H100 run (one process) spent ~1.1 s a test, nearly all of it compiling Triton
# kernels on the host: a few workers on the GPU host's 16 cores share the one GPU.
GPU_WORKERS = 4
_SUMMARY = re.compile(r"=+ (.*\bin [\d.]+s.*) =+$")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def parse_pytest_log(text: str) -> dict:
    """Counts from pytest ``-v`` output; the final summary line wins when pytest got there."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0, "xpassed": 0}
    failures = []
    for line in text.splitlines():
        m = _LINE.match(line)
        x = None if m else _XDIST_LINE.match(line)
        test, outcome = (m[1], m[2]) if m else (x[2], x[1]) if x else (None, None)
        if test:
            key = {"ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed"}.get(outcome, outcome.lower())
            counts[key] += 1
            if outcome in ("FAILED", "ERROR"):
                failures.append(test)
    summary = None
    for line in text.splitlines():
        m = _SUMMARY.search(line.strip())
        if m and _COUNT.search(m[1]):
            summary = m[1]
    if summary:
        final = dict.fromkeys(counts, 0)
        for n, kind in _COUNT.findall(summary):
            kind = {"errors": "error"}.get(kind, kind)
            if kind in final:
                final[kind] = int(n)
        counts = final
    return {**counts, "failures": failures, "summary_line": summary}


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def run(out_dir: Path, budget: Budget, dry_run: bool, meta: dict) -> Recorder:
    from pallas_kernels.backend import interpret_mode

    rec = Recorder(out_dir, "kernels", meta)
    interp = interpret_mode()
    on_gpu = meta["platform"] != "cpu"
    rec.set("interpret_mode", interp)
    # Dry run: one fast file interpreted on CPU (checks the harness, not the kernels).
    target = ["tests/kernels/test_cache_ops.py"] if dry_run else ["tests/kernels"]
    # The C++ CPU kernels (jax.ffi on the host) are CI's to test; on a GPU host they would only
    # spend the budget compiling C++. Not -x: a first failure must not hide the others, but
    # --maxfail keeps a broken backend from eating the whole budget on one traceback each.
    ignore = [] if dry_run or not on_gpu else [f"--ignore=tests/kernels/{f}" for f in CPU_ONLY_FILES]
    log_path = out_dir / "kernels_pytest.log"
    junit = out_dir / "kernels_junit.xml"
    workers = [] if dry_run or not on_gpu or not _has_xdist() else ["-n", str(GPU_WORKERS)]
    cmd = [sys.executable, "-m", "pytest", *target, *ignore, *workers, "--maxfail=40", "-v",
           "-p", "no:cacheprovider", "-o", "addopts=-ra", f"--junitxml={junit}"]
    env = {k: v for k, v in os.environ.items() if k != "PAGEDJAX_PALLAS_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    rec.set("command", " ".join(cmd))
    timeout = max(10.0, budget.left())
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: xdist workers die with it
        while proc.poll() is None:  # progress into the JSON every few seconds
            if time.monotonic() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                timed_out = True
                break
            time.sleep(2.0)
            rec.set("progress", parse_pytest_log(log_path.read_text(errors="replace")))
        proc.wait()
    res = parse_pytest_log(log_path.read_text(errors="replace"))
    res.update(returncode=proc.returncode, timed_out=timed_out,
               wall_s=round(time.monotonic() - t0, 1))
    rec.data.pop("progress", None)
    rec.set("pytest", res)
    ok = (proc.returncode == 0 and not timed_out and res["failed"] == 0 and res["error"] == 0
          and res["passed"] > 0)
    what = "real Triton kernels" if not interp else "interpreted"
    rec.summarize(f"pytest {' '.join(target)}",
                  f"{res['passed']} passed, {res['failed']} failed, {res['error']} errors, "
                  f"{res['skipped']} skipped ({what}){', TIMED OUT' if timed_out else ''}",
                  "pass" if ok else "FAIL")
    if on_gpu and interp:
        rec.summarize("kernels ran non-interpreted", "interpret_mode() is True on a GPU", "FAIL")
    rec.finish("done" if ok else "failed")
    return rec
