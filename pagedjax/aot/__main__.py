"""``python -m pagedjax.aot``: compile every kernel configuration and the engine step for
compile-only GPU targets and write ``bench/results/aot-<target>/report.json``."""

from __future__ import annotations

import os

from pagedjax.aot.resources import LOG_ENV

# Before jax loads: the CPU-only client, and the C++ log level that carries ptxas' report.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _k, _v in LOG_ENV.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from pagedjax.aot import report  # noqa: E402
from pagedjax.aot.target import ALL_TARGETS, REQUIRED_TARGETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(ALL_TARGETS),
                        help=f"comma-separated, of {ALL_TARGETS}")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel sweep")
    parser.add_argument("--no-steps", action="store_true", help="skip the engine steps")
    parser.add_argument("--reuse-kernels", action="store_true",
                        help="keep the kernel sweep of the existing report (after a change that "
                             "touches only the engine step) and rebuild the steps")
    parser.add_argument("--reuse-compiled", action="store_true",
                        help="compile only kernel configurations the existing report lacks "
                             "(after adding configurations, not changing kernels; the compile "
                             "tier's test rebuilds everything and checks it)")
    parser.add_argument("--out", type=Path, default=report.REPORT_DIR)
    args = parser.parse_args()
    report.check_backend()
    failed = False
    for target in args.targets.split(","):
        old = report.load(target, args.out) if args.reuse_kernels else None
        rep = report.build(target, kernels=not (args.no_kernels or args.reuse_kernels),
                           steps=not args.no_steps,
                           reuse=report.load(target, args.out) if args.reuse_compiled else None)
        if old is not None:  # same key order as a full build: kernels before steps
            steps = rep.pop("steps", None)
            rep.pop("summary")
            rep["kernels"] = old["kernels"]
            if steps is not None:
                rep["steps"] = steps
            rep["summary"] = report.summarize(rep)
        path = report.write(rep, args.out)
        bad = report.problems(rep)
        print(f"{target}: {rep['summary']} -> {path}")
        for line in bad:
            print(f"  FAIL {line}")
        failed |= bool(bad) and target in REQUIRED_TARGETS
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
