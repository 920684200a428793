"""The serving engine thread's time per step outside the engine: handing a step's outputs to
the clients' streams (`AsyncEngine`), against an earlier commit, interleaved.

    .venv/bin/python bench/stream_delivery.py --base COMMIT [--streams 256] [--reps 3]

Every server (`pagedjax serve`'s HTTP and gRPC front ends) runs the engine on one thread and
its clients on an asyncio loop in the same process. Each step's outputs go to the requests'
streams on the engine thread, between two steps, so that time adds to every step. This
measures it with the engine stubbed: a step sleeps ``--device-ms`` (the device's time, the GIL
released, as while JAX waits for a result) and returns one delta output per stream. The
clients are ``--streams`` asyncio consumers that turn each output into an SSE-like JSON chunk,
as the HTTP server does. Timed: from the end of one `engine.step()` to the start of the
next, on the engine thread, over the steps that delivered to every stream.

Checks COMMIT out into a temporary git worktree and runs this script's ``--child`` with that
tree's `pagedjax` and with this working tree's in turn (one process each, the order
alternating every rep), recording the 1-minute load average before each run. Writes
bench/results/cpu/stream_delivery.json and .png (``--out``).
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
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.base_tree import base_tree  # noqa: E402


class _StubEngine:
    """What `AsyncEngine` calls on an `LLMEngine`, with steps that only sleep and emit."""

    def __init__(self, device_s: float, streams: int) -> None:
        from pagedjax.outputs import CompletionOutput, RequestOutput

        self._out, self._comp = RequestOutput, CompletionOutput
        self.device_s, self.streams = device_s, streams
        self.reqs: dict[str, list] = {}  # request id -> [tokens made, max_tokens]
        self.host_s: list[float] = []  # engine-thread time between steps, full steps only
        self._left_at: float | None = None
        self._last_full = False
        self._pending: list = []

    def get_stats(self):
        return types.SimpleNamespace(healthy=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs) or bool(self._pending)

    def add_request(self, request_id, prompt, params=None, prompt_token_ids=None, **kw):
        self.reqs[request_id] = [0, params.max_tokens]

    def abort_request(self, request_id, withdraw: bool = False):
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if self.reqs.pop(rid, None) is not None and not withdraw:
                self._pending.append(self._out(rid, None, [1], [self._comp(0, "", [], None, None,
                                                                             "abort")], True))

    def step(self):
        now = time.perf_counter()
        if self._left_at is not None and self._last_full:
            self.host_s.append(now - self._left_at)
        time.sleep(self.device_s)
        outs, self._pending = self._pending, []
        for rid, r in list(self.reqs.items()):
            r[0] += 1
            done = r[0] >= r[1]
            if done:
                del self.reqs[rid]
            outs.append(self._out(rid, None, [1, 2, 3], [self._comp(
                0, " tok", [100 + r[0]], None, None, "length" if done else None)], done))
        self._last_full = len(outs) == self.streams and not any(o.finished for o in outs)
        self._left_at = time.perf_counter()
        return outs


def child(streams: int, tokens: int, device_ms: float) -> dict:
    import asyncio

    from pagedjax.sampling_params import SamplingParams
    from pagedjax.serving.async_engine import AsyncEngine

    stub = _StubEngine(device_ms / 1e3, streams)
    aeng = AsyncEngine(stub).start()
    received = [0]

    async def read(stream) -> None:
        async for out in stream:
            for c in out.outputs:  # what the HTTP server writes per chunk
                json.dumps({"id": out.request_id, "object": "text_completion",
                            "choices": [{"index": c.index, "text": c.text,
                                         "finish_reason": c.finish_reason}]})
                received[0] += len(c.token_ids)

    async def main() -> float:
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        items = [(f"s{i}", "x", [1, 2, 3]) for i in range(streams)]
        t0 = time.perf_counter()
        got = await aeng.add_requests_async(items, sp, delta=True)
        await asyncio.gather(*(read(s) for s in got))
        return time.perf_counter() - t0

    cpu0 = time.process_time()
    try:
        wall = asyncio.run(main())
    finally:
        aeng.shutdown()
    cpu = time.process_time() - cpu0
    assert received[0] == streams * tokens, (received[0], streams * tokens)
    h = sorted(stub.host_s)
    return {"steps_timed": len(h), "host_ms_median": 1e3 * statistics.median(h),
            "host_ms_p99": 1e3 * h[min(len(h) - 1, int(0.99 * len(h)))],
            "host_ms_max": 1e3 * h[-1], "wall_s": wall,
            "cpu_ms_per_step": 1e3 * cpu / tokens, "tokens_received": received[0]}


def run(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench/stream_delivery.py"), "--child",
                           "--streams", str(args.streams), "--tokens", str(args.tokens),
                           "--device-ms", str(args.device_ms)], env=env, cwd=tree, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit to compare against")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=120, help="delta outputs per stream")
    ap.add_argument("--device-ms", type=float, default=20.0, help="a stubbed step's sleep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help="one measurement, as JSON")
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/stream_delivery.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.streams, args.tokens, args.device_ms)))
        return
    if not args.base:
        ap.error("--base is required (or --child)")
    runs = []
    with base_tree(args.base) as bt:
        base_sha, head, dirty, base = bt.base_sha, bt.head, bt.dirty, bt.path
        for rep in range(args.reps):
            for which in (("base", "new") if rep % 2 == 0 else ("new", "base")):
                load = os.getloadavg()[0]
                r = run(base if which == "base" else ROOT, args)
                runs.append({"rep": rep, "version": which, "load_avg_1m_before": load, **r})
                print(f"rep {rep} {which} (load {load:.2f}): host ms median "
                      f"{r['host_ms_median']:.3f} p99 {r['host_ms_p99']:.3f}, process CPU "
                      f"{r['cpu_ms_per_step']:.2f} ms a step", flush=True)
    keys = ("host_ms_median", "host_ms_p99", "wall_s", "cpu_ms_per_step")
    med = {v: {k: statistics.median(x[k] for x in runs if x["version"] == v) for k in keys}
           for v in ("base", "new")}
    res = {"what": "serving engine thread: ms per step outside engine.step() (handing outputs "
                   "to asyncio streams), engine stubbed; median over reps of per-process figures",
           "command": "python bench/stream_delivery.py " + " ".join(sys.argv[1:]),
           "streams": args.streams, "tokens": args.tokens, "device_ms": args.device_ms,
           "base": base_sha, "new": head + (" + working tree changes" if dirty else ""),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "python": platform.python_version()},
           "median": med, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    for v in ("base", "new"):
        print(f"{v}: host ms per step median {med[v]['host_ms_median']:.3f}, "
              f"p99 {med[v]['host_ms_p99']:.3f}; process CPU {med[v]['cpu_ms_per_step']:.2f} ms "
              f"a step; wall {med[v]['wall_s']:.2f} s")


def plot(res: dict, path: Path) -> None:
    """Base against new: the engine thread's time between steps and the process's CPU a step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("host_ms_median", "engine thread\nbetween steps, median"),
            ("host_ms_p99", "engine thread\nbetween steps, p99"),
            ("cpu_ms_per_step", "process CPU\na step"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, v in enumerate(("base", "new")):
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(keys))],
               [res["median"][v][k] for k, _ in keys], 0.4,
               label=f"{v} ({res[v][:7]})")
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    ax.set_ylabel("ms (median of reps)")
    ax.set_title(f"{res['streams']} streams, stubbed {res['device_ms']:g} ms steps", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
