"""`DetokState.append` per step for sequences decoding in step, against the merging pieces it
used to keep.

    .venv/bin/python bench/detok_append.py [--seqs 256] [--steps 1600] [--reps 3]

Each step appends one token's text (cycling " abc", " hello", "x", " world!": ~4.5 characters
a token, as the demo tokenizer's English) to every sequence's state and is timed as a whole:
what a streamed decode step's text costs at ``--seqs`` rows. `merging` is the policy before
stop 75 (a full tail became a piece that merged into the one before while at least half its
length: O(log n) pieces, but a merge cascade copies up to the whole text in one step, and
sequences in step cascade in the same one); `pieces` is `DetokState` as it is (a full tail
becomes a piece of its own). The two run interleaved, rep by rep, each after a full
collection and with the collector off while it runs (its passes would land on either
policy's steps alike and blur what the policies cost). Reports per policy the
median, p99 and slowest step, the mean, and per rep the steps over 0.15 ms (a cascade's
mark: 3-5x the median), with the load average at the start; writes
bench/results/cpu/detok_append.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedjax.detokenizer import DetokState  # noqa: E402

PIECES = (" abc", " hello", "x", " world!")


class MergingState(DetokState):
    """The policy before stop 75, for comparison: pieces merge geometrically. Its `append` is
    the old method whole, not a `super().append` plus the merge, so the baseline pays no
    extra call per append that the engine's version did not."""

    __slots__ = ()

    def append(self, piece: str) -> None:
        tail = self._tail + piece
        self.length += len(piece)
        if len(tail) < self.TAIL:
            self._tail = tail
            return
        self._tail = ""
        parts = self._parts
        parts.append(tail)
        while len(parts) > 1 and 2 * len(parts[-1]) >= len(parts[-2]):
            last = parts.pop()
            parts[-1] += last


def run(cls: type[DetokState], seqs: int, steps: int) -> tuple[np.ndarray, str]:
    """Per-step ms of ``steps`` steps of one append to each of ``seqs`` states, and one
    state's text (the two policies must agree on it)."""
    states = [cls() for _ in range(seqs)]
    ms = np.empty(steps)
    gc.collect()
    gc.disable()
    try:
        for step in range(steps):
            piece = PIECES[step % len(PIECES)]
            t0 = time.perf_counter()
            for s in states:
                s.append(piece)
            ms[step] = (time.perf_counter() - t0) * 1e3
    finally:
        gc.enable()
    return ms, states[0].text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/detok_append.json"))
    args = ap.parse_args()
    load = os.getloadavg()[0]
    policies = {"merging": MergingState, "pieces": DetokState}
    steps: dict[str, list[np.ndarray]] = {k: [] for k in policies}
    texts = set()
    for rep in range(args.reps):
        order = list(policies) if rep % 2 == 0 else list(policies)[::-1]
        for name in order:
            ms, text = run(policies[name], args.seqs, args.steps)
            steps[name].append(ms)
            texts.add(text)
    if len(texts) != 1:
        sys.exit("the two policies' texts differ")
    summary = {}
    for name, runs in steps.items():
        a = np.concatenate(runs)
        summary[name] = {"median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
                         "max_ms": float(a.max()), "mean_ms": float(a.mean()),
                         "steps_over_0.15_ms_per_rep": [int((r > 0.15).sum()) for r in runs],
                         "slowest_steps": sorted(int(i) for i in np.argsort(runs[0])[-8:])}
    res = {"what": "ms per step of one DetokState.append to each sequence, sequences in step "
                   "(bench/detok_append.py)",
           "command": "python bench/detok_append.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "python": platform.python_version(), "seqs": args.seqs, "steps": args.steps,
           "reps": args.reps, "characters_at_end": len(texts.pop()), "policies": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:8s} median {s['median_ms']:.4f} ms, p99 {s['p99_ms']:.4f}, "
              f"slowest {s['max_ms']:.3f}, mean {s['mean_ms']:.4f}, steps over 0.15 ms per "
              f"rep {s['steps_over_0.15_ms_per_rep']}")


if __name__ == "__main__":
    main()
