"""The OpenAI HTTP front end under many streaming clients, engine stubbed: the server's CPU a
step and the engine thread's wait between steps, on uvloop's event loop against asyncio's.

    .venv/bin/python bench/http_stream.py [--streams 256] [--tokens 300] [--reps 3]

The server runs in one process as `pagedjax serve` does (`run_server`: gRPC, HTTP and the
engine thread, which shares the GIL with the event loop), over the serving tests' JAX-free
engine (`tests/serving/fake_engine.py`): a step sleeps ``--step-ms`` (the device's time, the GIL
released) and gives every request one token. ``--streams`` clients in another process
(httpx) each stream one completion of ``--tokens`` tokens over SSE. Measured in the server's
process: its CPU time a step (engine thread, event loop, gRPC's poller) and, on the engine
thread, the time from the end of one step to the start of the next while every stream is
open. Each run is a fresh server process; the loops alternate (``PAGEDJAX_UVLOOP=1/0``), the
order turning every rep, with the 1-minute load average recorded before each run. The client
process shares this machine's cores, so wall times are the pair's, not the server's alone.
Writes bench/results/cpu/http_stream.json and .png (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def client(port: int, streams: int, tokens: int) -> None:
    import asyncio

    import httpx

    async def one(c) -> int:
        chunks = 0
        body = {"model": "fake", "prompt": "hi", "max_tokens": tokens, "stream": True}
        async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                chunks += line.startswith("data: {")
        return chunks

    async def main() -> None:
        limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
        async with httpx.AsyncClient(limits=limits, timeout=300) as c:
            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(c) for _ in range(streams)))
            print(json.dumps({"chunks": sum(got), "client_wall_s": time.perf_counter() - t0}))

    asyncio.run(main())


class _GapLog:
    """The engine thread's time from the end of one step to the start of the next while every
    stream is open, and the process's CPU then; written to ``path`` (one line a step) when the
    engine runs in another process."""

    def __init__(self, fake, streams: int, path: str | None = None):
        self.fake, self.streams = fake, streams
        self.gaps: list[float] = []
        self.left: float | None = None
        self.left_cpu = 0.0
        self.file = open(path, "a", buffering=1) if path else None
        self.step = fake.step
        fake.step = self.timed_step

    def timed_step(self):
        t, cpu = time.perf_counter(), time.process_time()
        if self.left is not None and len(self.fake._reqs) == self.streams:
            self.gaps.append(t - self.left)
            if self.file is not None:  # the gap, the CPU then, and the CPU the gap took
                self.file.write(f"{t - self.left} {cpu} {cpu - self.left_cpu}\n")
        out = self.step()
        self.left, self.left_cpu = time.perf_counter(), time.process_time()
        return out


def timed_fake(streams: int, tokens: int, step_ms: float, path: str | None = None):
    """The stubbed engine, its steps timed (`EngineProcess` builds it in its child)."""
    sys.path.insert(0, str(ROOT))
    from tests.serving.fake_engine import FakeEngine

    fake = FakeEngine(step_s=step_ms / 1e3)
    fake.max_model_len = tokens + 64
    fake.gap_log = _GapLog(fake, streams, path)
    return fake


def child(streams: int, tokens: int, step_ms: float, engine_process: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench.http_stream import timed_fake as factory  # by module: the child imports it
    from pagedjax.serving.engine_process import EngineProcess
    from pagedjax.serving.server import new_event_loop
    from tests.serving.inproc import InProcessServer

    probe = new_event_loop()  # the kind `run_server`'s loop is
    loop_kind = type(probe).__module__.split(".")[0]
    probe.close()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = str(Path(tmp) / "gaps.txt")
        if engine_process:
            engine = EngineProcess(factory, streams, tokens, step_ms, log_path)
        else:
            engine = factory(streams, tokens, step_ms)
        srv = InProcessServer(engine, Path(tmp), port=None, metrics_port=None, http_port=0,
                              max_waiting_requests=None, max_sequences_per_request=None).start()
        try:
            cpu0, steps0 = time.process_time(), engine.get_stats().num_steps
            proc = subprocess.run([sys.executable, __file__, "--client",
                                   str(srv.ports["http_port"]), "--streams", str(streams),
                                   "--tokens", str(tokens)], check=True, capture_output=True,
                                  text=True)
            cpu, steps = time.process_time() - cpu0, engine.get_stats().num_steps - steps0
        finally:
            srv.close()
            if engine_process:
                engine.close()
        if engine_process:
            rows = [tuple(map(float, line.split())) for line in open(log_path)]
            gaps, core_cpu = [r[0] for r in rows], [r[1] for r in rows]
            gap_cpu = sorted(r[2] for r in rows)
        else:
            gaps, core_cpu = engine.gap_log.gaps, []
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # A stream whose client has not read its last chunk yet takes the next one merged in.
    assert res["chunks"] <= streams * tokens and steps >= tokens, (res, steps)
    g = sorted(gaps)
    out = {"loop": loop_kind, "engine": "process" if engine_process else "thread",
           "steps": steps, "server_cpu_ms_per_step": 1e3 * cpu / steps,
           "engine_gap_ms_median": 1e3 * statistics.median(g),
           "engine_gap_ms_p99": 1e3 * g[min(len(g) - 1, int(0.99 * len(g)))],
           "steps_with_every_stream_open": len(g), **res}
    if core_cpu:  # the engine process's own CPU a step, over the steps with every stream open
        out["engine_process_cpu_ms_per_step"] = 1e3 * (core_cpu[-1] - core_cpu[0]) / max(
            1, len(core_cpu) - 1)
        # Of which between steps (sending the outputs, taking commands), median.
        out["engine_process_cpu_ms_between_steps"] = 1e3 * statistics.median(gap_cpu)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=300, help="SSE chunks per stream")
    ap.add_argument("--step-ms", type=float, default=20.0, help="a stubbed step's sleep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help="one server run, as JSON")
    ap.add_argument("--client", type=int, metavar="PORT", help="the clients, against PORT")
    ap.add_argument("--compare", choices=("loop", "engine-process", "base"), default="loop",
                    help="uvloop against asyncio, the engine on the server's thread against "
                         "the engine in its own process (`--engine-process`), both on uvloop, "
                         "or this tree against the checkout at --base (a `git worktree` of an "
                         "earlier commit), both on uvloop")
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="with --compare base: the other checkout, whose server the same "
                         "clients drive")
    ap.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/http_stream.json"))
    args = ap.parse_args()
    if args.client:
        client(args.client, args.streams, args.tokens)
        return
    if args.child:
        print(json.dumps(child(args.streams, args.tokens, args.step_ms, args.engine_process)))
        return
    # (label, PAGEDJAX_UVLOOP, child arguments, checkout)
    if args.compare == "loop":
        variants = [("uvloop", "1", [], ROOT), ("asyncio", "0", [], ROOT)]
    elif args.compare == "engine-process":
        variants = [("engine thread", "1", [], ROOT),
                    ("engine process", "1", ["--engine-process"], ROOT)]
    else:
        if not args.base:
            ap.error("--compare base needs --base DIR")
        variants = [("this tree", "1", [], ROOT), ("base", "1", [], Path(args.base).resolve())]
    runs = []
    for rep in range(args.reps):
        for label, uv, extra, tree in (variants if rep % 2 == 0 else variants[::-1]):
            load = os.getloadavg()[0]
            # (Its own copy of this script: the child imports the server from its checkout.)
            proc = subprocess.run([sys.executable, str(tree / "bench/http_stream.py"), "--child",
                                   "--streams", str(args.streams), "--tokens", str(args.tokens),
                                   "--step-ms", str(args.step_ms), *extra],
                                  env={**os.environ, "PAGEDJAX_UVLOOP": uv},
                                  check=True, capture_output=True, text=True, cwd=tree)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append({"rep": rep, "variant": label, "load_avg_1m_before": load, **r})
            core = r.get("engine_process_cpu_ms_per_step")
            print(f"rep {rep} {label:14s} (load {load:.2f}): server CPU "
                  f"{r['server_cpu_ms_per_step']:.2f} ms a step"
                  + (f" (+ engine process {core:.2f})" if core is not None else "")
                  + f", engine between steps {r['engine_gap_ms_median']:.2f} / p99 "
                  f"{r['engine_gap_ms_p99']:.2f} ms, client wall {r['client_wall_s']:.2f} s",
                  flush=True)
    keys = ("server_cpu_ms_per_step", "engine_gap_ms_median", "engine_gap_ms_p99",
            "client_wall_s")
    med = {lp: {k: statistics.median(x[k] for x in runs if x["variant"] == lp) for k in keys}
           for lp, *_ in variants}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    import httpx
    import uvicorn
    import uvloop

    res = {"what": "OpenAI HTTP front end, stubbed engine, SSE clients in another process: "
                   "server CPU ms a step and the engine thread's ms between steps, median over "
                   "reps of per-run figures, " + " against ".join(v[0] for v in variants)
                   + ", alternating",
           "command": "python bench/http_stream.py " + " ".join(sys.argv[1:]),
           "commit": head, "streams": args.streams, "tokens": args.tokens,
           **({"base_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.base,
                                             capture_output=True, text=True).stdout.strip()}
              if args.compare == "base" else {}),
           "step_ms": args.step_ms,
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "python": platform.python_version()},
           "versions": {"uvloop": uvloop.__version__, "uvicorn": uvicorn.__version__,
                        "httpx": httpx.__version__},
           "median": med, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    for lp in med:
        print(f"{lp}: " + ", ".join(f"{k} {v:.2f}" for k, v in med[lp].items()))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("server_cpu_ms_per_step", "server CPU\na step"),
            ("engine_gap_ms_median", "engine thread\nbetween steps, median"),
            ("engine_gap_ms_p99", "engine thread\nbetween steps, p99"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, lp in enumerate(sorted(res["median"])):
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(keys))],
               [res["median"][lp][k] for k, _ in keys], 0.4, label=lp)
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    ax.set_ylabel("ms (median of reps)")
    ax.set_title(f"{res['streams']} SSE clients, stubbed {res['step_ms']:g} ms steps",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
