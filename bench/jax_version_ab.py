"""pagedjax offline throughput under two jax/jaxlib versions, runs interleaved A,B,A,B.

`python bench/jax_version_ab.py [--versions 0.12.0.1,0.12.1] [--reps 2]`: for each rep and
version it installs that jax and jaxlib into this venv, waits for a quiet machine (1-minute
load under 0.45), runs `bench/offline_throughput.py --engines pagedjax --workloads
1x128,64x128 --reps 1` and records its figures with the load average. The venv keeps the
last version of the list. Why: a fresh install picks the newest jax the project allows, so
a published figure should hold for it as well as for the version it was measured with.
Writes `bench/results/cpu/jax_version_ab.json` (+ `.png`) unless `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("1x128", "64x128")


def install(version: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"jax=={version}",
                    f"jaxlib=={version}"], check=True)


def wait_quiet(limit: float = 0.45) -> float:
    while (load := os.getloadavg()[0]) > limit:
        time.sleep(15)
    return load


def run_once(version: str, rep: int, tmp: Path) -> dict:
    out = tmp / f"{version}_{rep}.json"
    load = wait_quiet()
    subprocess.run([sys.executable, str(ROOT / "bench" / "offline_throughput.py"), "--engines",
                    "pagedjax", "--workloads", ",".join(WORKLOADS), "--reps", "1",
                    "--max-load", "0.6", "--out", str(out)], check=True, cwd=ROOT)
    d = json.loads(out.read_text())
    s = d["summary"]
    return {"rep": rep, "jax": d["versions"]["pagedjax"]["jax"],
            "load_avg_1m_at_start": round(load, 2), "cpu": d["machine"]["cpu"],
            **{f"tok_s_{w}": round(s[w]["pagedjax"]["tokens_per_s_median"], 1) for w in WORKLOADS},
            "ttft_ms_1x128": round(s["1x128"]["pagedjax"]["ttft_ms_median"], 1)}


def plot(runs: list[dict], versions: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(8, 3.2))
    for ax, w in zip(axes, WORKLOADS, strict=True):
        for i, v in enumerate(versions):
            ys = [r[f"tok_s_{w}"] for r in runs if r["jax"] == v]
            ax.scatter([i] * len(ys), ys, label=v)
        ax.set_xticks(range(len(versions)), versions)
        ax.set_title(f"pagedjax {w}")
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default="0.12.0.1,0.12.1")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/jax_version_ab.json")
    args = ap.parse_args()
    versions = args.versions.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(1, args.reps + 1):
            for v in versions:
                install(v)
                runs.append(run_once(v, rep, Path(tmp)))
                print(runs[-1], flush=True)
    result = {"what": "pagedjax offline throughput (greedy fp32, SmolLM2-135M demo weights) "
                      "under each jax/jaxlib version in the same venv, runs interleaved",
              "command": "python " + " ".join(sys.argv), "cpu_count": os.cpu_count(),
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, versions, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
