"""Urgent requests behind a backlog: FCFS against priority scheduling (vLLM's
`--scheduling-policy priority`), on the demo model.

    .venv/bin/python bench/priority_latency.py [--reps 2] [--backlog 48] [--urgent 8] [--slots 8]

One engine per policy, built alike (SmolLM2-135M fp32 from the demo GGUF, `max_num_seqs` =
`--slots`, defaults otherwise), fed the same token ids. `--backlog` priority-1 requests
(128-token prompts, 32 greedy new tokens each, EOS ignored) are queued at once; after the
engine's 4th step `--urgent` priority-0 requests (128-token prompts, 16 new tokens) arrive.
Reported per policy: each urgent request's time to first token and to its last token from its
arrival (median, max), the backlog's completion time, generated tokens/s over the whole run,
preemptions, and how many requests' tokens equal the other policy's. Each engine runs once
untimed first (its compiles); then the timed runs alternate fcfs, priority, fcfs, ... The
1-minute load average is recorded, and a run refused above `--max-load`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def workload(backlog: int, urgent: int, seed: int = 0) -> list[tuple[str, list[int], int, int]]:
    """(request id, prompt ids, max_tokens, priority): the backlog first, then the urgent."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(backlog + urgent):
        ids = [int(t) for t in rng.integers(200, 20000, 128)]
        out.append((f"b{i}", ids, 32, 1) if i < backlog else (f"u{i - backlog}", ids, 16, 0))
    return out


def run(llm, reqs, policy: str, urgent_after: int = 4) -> dict:
    """One pass of the workload on a fresh queue; times from `time.perf_counter`."""
    from pagedjax import SamplingParams

    eng = llm.engine
    llm.reset_prefix_cache()  # every pass computes its prompts (no hits from the last)
    prio = policy == "priority"
    before = eng.scheduler.num_preemptions_total
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    def add(batch):
        for rid, ids, n, p in batch:
            eng.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True),
                            prompt_token_ids=ids, output_kind="delta",
                            priority=p if prio else 0)
            arrival[rid] = time.perf_counter()

    backlog = [r for r in reqs if r[3] == 1]
    late = [r for r in reqs if r[3] == 0]
    t0 = time.perf_counter()
    add(backlog)
    steps = 0
    while eng.has_unfinished_requests() or late:
        if steps == urgent_after and late:
            add(late)
            late = []
        outs = eng.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            new = o.outputs[0].token_ids
            if new:
                first.setdefault(o.request_id, now)
                tokens.setdefault(o.request_id, []).extend(new)
            if o.finished:
                last[o.request_id] = now
    wall = time.perf_counter() - t0
    urg = [r[0] for r in reqs if r[3] == 0]
    ttft = [1e3 * (first[r] - arrival[r]) for r in urg]
    e2e = [1e3 * (last[r] - arrival[r]) for r in urg]
    return {"policy": policy, "steps": steps, "wall_s": wall,
            "generated_tok_s": sum(len(v) for v in tokens.values()) / wall,
            "urgent_ttft_ms_median": statistics.median(ttft), "urgent_ttft_ms_max": max(ttft),
            "urgent_done_ms_median": statistics.median(e2e), "urgent_done_ms_max": max(e2e),
            "backlog_done_s": max(last[r[0]] for r in reqs if r[3] == 1) - t0,
            "preemptions": eng.scheduler.num_preemptions_total - before,
            "tokens": tokens}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    pols = ["fcfs", "priority"]
    summ = res["summary"]
    x = np.arange(2)
    a.bar(x - 0.2, [summ[p]["urgent_ttft_ms_median"] for p in pols], 0.4, label="TTFT median")
    a.bar(x + 0.2, [summ[p]["urgent_done_ms_median"] for p in pols], 0.4,
          label="last token, median")
    a.set_xticks(x, pols)
    a.set_ylabel("ms from the urgent request's arrival")
    a.set_title(f"{res['workload']['urgent']} urgent requests behind "
                f"{res['workload']['backlog']} ({res['workload']['slots']} slots)")
    a.legend()
    b.bar(pols, [summ[p]["generated_tok_s"] for p in pols], color="tab:green")
    b.set_ylabel("generated tokens / s, whole run")
    b.set_title("throughput (preempted work is recomputed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backlog", type=int, default=48)
    ap.add_argument("--urgent", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-load", type=float, default=0.6)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/priority_latency.json"))
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(f"1-minute load average {load:.2f} > {args.max_load}: a busy machine "
                         "gives no result (--max-load to override)")
    import jax

    from models.demo import ensure_demo_model
    from pagedjax import LLM

    gguf = ensure_demo_model()
    reqs = workload(args.backlog, args.urgent)
    kw = dict(dtype="float32", max_num_seqs=args.slots, max_model_len=256)
    llms = {p: LLM(str(gguf), scheduling_policy=p, **kw) for p in ("fcfs", "priority")}
    for p, llm in llms.items():  # untimed: compiles
        run(llm, reqs, p)
    rows = []
    for _ in range(args.reps):
        for p in ("fcfs", "priority"):
            rows.append(run(llms[p], reqs, p))
            print({k: (round(v, 2) if isinstance(v, float) else v)
                   for k, v in rows[-1].items() if k != "tokens"}, flush=True)
    same = sum(rows[0]["tokens"][r] == rows[1]["tokens"][r] for r in rows[0]["tokens"])
    summary = {}
    for p in ("fcfs", "priority"):
        mine = [r for r in rows if r["policy"] == p]
        summary[p] = {k: statistics.median(r[k] for r in mine)
                      for k in ("urgent_ttft_ms_median", "urgent_ttft_ms_max",
                                "urgent_done_ms_median", "urgent_done_ms_max",
                                "backlog_done_s", "generated_tok_s", "preemptions", "steps")}
    for r in rows:
        del r["tokens"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res = {"what": "bench/priority_latency.py (see its docstring); medians over --reps",
           "command": "python bench/priority_latency.py " + " ".join(sys.argv[1:]),
           "commit": commit,
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load,
                       "load_avg_1m_at_end": os.getloadavg()[0]},
           "versions": {"jax": jax.__version__, "python": platform.python_version()},
           "workload": {"backlog": args.backlog, "urgent": args.urgent, "slots": args.slots,
                        "prompt_tokens": 128, "backlog_max_tokens": 32,
                        "urgent_max_tokens": 16, "urgent_after_steps": 4},
           "identical_tokens_fcfs_vs_priority": f"{same}/{len(reqs)}",
           "summary": summary, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
