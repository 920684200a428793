"""Every kernel configuration the engine can pick, and the whole engine step, compile for
H100 and A100 with no failures, no spills and shared memory within the limit; and the
committed report (bench/results/aot-<target>/report.json) is what the code compiles today.

The check lowers every configuration and step (cheap) and compares each IR digest with the
report's, and compiles a sample again (the kernels nearest the limits, a stride through the
sweep, steps of every model and TP kind) to the recorded resources: with the toolchain the
same, equal IR is an equal compile (`pagedjax.aot.fingerprint`). `make aot-full` compiles
everything instead. After changing a kernel, the tuning table or the step, regenerate the
reports with `make aot-report` (it compiles only what changed) and commit them.
"""

from __future__ import annotations

import os

import pytest

from pagedjax.aot import report
from pagedjax.aot.target import REQUIRED_TARGETS

FULL = os.environ.get("PAGEDJAX_AOT_FULL") == "1"


# Each target in its own xdist group (`make test` runs this folder with --dist loadgroup), so
# the two longest tests of the tier run on both workers side by side.
@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.xdist_group(f"tier_{t}"))
                                    for t in REQUIRED_TARGETS])
def test_target_compiles_clean_and_matches_committed_report(target):
    path = report.report_path(target)
    assert path.exists(), f"missing {path}: run `make aot-report`"
    committed = report.load(target)
    assert report.problems(committed) == []
    s = committed["summary"]
    assert s["engine_configs"] >= 2 * 6 * 3 * 3 * 8  # decode+ragged x bs x d x dtype x group
    assert s["steps"] >= 7
    if FULL:
        fresh = report.build(target)
        assert report.problems(fresh) == []
        diffs = report.differences(committed, fresh)
    else:
        diffs = report.verify(target, committed)
    assert not diffs, (f"{path} is stale (run `make aot-report TARGETS={target}` and commit "
                       "it):\n" + "\n".join(diffs))
