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
    parser.add_argument("--fresh", action="store_true",
                        help="compile every kernel again; by default a kernel whose lowered "
                             "IR and toolchain match the existing report keeps its entry")
    parser.add_argument("--out", type=Path, default=report.REPORT_DIR)
    args = parser.parse_args()
    report.check_backend()
    failed = False
    for target in args.targets.split(","):
        path = report.report_path(target, args.out)
        old = None if args.fresh or not path.exists() else report.load(target, args.out)
        rep = report.build(target, kernels=not args.no_kernels, steps=not args.no_steps,
                           reuse=old)
        path = report.write(rep, args.out)
        bad = report.problems(rep)
        print(f"{target}: {rep['summary']} -> {path}")
        for line in bad:
            print(f"  FAIL {line}")
        failed |= bool(bad) and target in REQUIRED_TARGETS
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
