"""Serving load generator: Poisson arrivals over the gRPC / HTTP front doors vs the engine in-process.

For each request rate the same synthetic workload (bench/workloads.py) is driven twice in one run:
through a `pagedjax serve` subprocess with the asyncio gRPC client (and, with `--protocols`
including `http`, its OpenAI front door over SSE), and through an `AsyncEngine`
in this process (same engine options), so the difference is the serving path's overhead (issue 7
target: gRPC adds <= 5% to normalized latency). Both are measured from the client side: TTFT,
TPOT, inter-token latency (between streamed messages), end-to-end and normalized latency
(e2e / output tokens, the vLLM paper's metric), throughput. Results: JSON + PNG under
bench/results/<device>/.

Each path first runs a short warm-up burst so compile time (large on CPU) is not measured; shapes
first seen later still compile inside the run unless `--warmup-passes` replays each rate's requests
untimed first (the JSON records the compilations that happened during each measured run). The
paths run one after the other, never at once, so they do not compete for the device or CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import WORKLOADS, Request, describe, make_requests  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Record:
    """Client-side timings of one request (perf_counter seconds)."""

    def __init__(self, sent: float):
        self.sent = sent
        self.times: list[float] = []
        self.tokens = 0
        self.end = 0.0
        self.error: str | None = None

    def token(self, n: int) -> None:
        if n > 0:
            self.times.append(time.perf_counter())
            self.tokens += n


def _params(r: Request) -> dict:
    return {"temperature": 0.0, "max_tokens": r.output_len, "ignore_eos": True}


async def _drive(reqs: list[Request], one) -> tuple[list[Record], float]:
    """Fire `one(request, record)` at each request's arrival offset; return records and wall time."""
    t0 = time.perf_counter()

    async def fire(r: Request) -> Record:
        await asyncio.sleep(max(0.0, t0 + r.arrival - time.perf_counter()))
        rec = Record(time.perf_counter())
        try:
            await one(r, rec)
        except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.end = time.perf_counter()
        return rec

    recs = await asyncio.gather(*(fire(r) for r in reqs))
    return list(recs), time.perf_counter() - t0


async def run_grpc(target: str, reqs: list[Request]) -> tuple[list[Record], float]:
    from pagedjax.serving.client import AsyncClient

    async with AsyncClient(target, timeout=3600) as client:
        async def one(r: Request, rec: Record) -> None:
            async for resp in client.generate_stream(r.prompt_token_ids, _params(r)):
                rec.token(sum(len(d.token_ids) for d in resp.outputs))

        return await _drive(reqs, one)


async def run_http(base_url: str, reqs: list[Request]) -> tuple[list[Record], float]:
    """The OpenAI front door: SSE streaming of /v1/completions with token-id prompts."""
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        async def one(r: Request, rec: Record) -> None:
            body = {"prompt": r.prompt_token_ids, "stream": True, **_params(r)}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        rec.token(1)  # one chunk per new token (the server sends per step)

        return await _drive(reqs, one)


async def run_inprocess(aeng, reqs: list[Request]) -> tuple[list[Record], float]:
    async def one(r: Request, rec: Record) -> None:
        stream = await aeng.add_request_async(f"b-{uuid.uuid4().hex}", None, _params(r), r.prompt_token_ids)
        seen = 0
        async for out in stream:
            n = len(out.outputs[0].token_ids)
            rec.token(n - seen)
            seen = n

    return await _drive(reqs, one)


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(recs: list[Record], wall: float) -> dict:
    ok = [r for r in recs if r.error is None and r.times]
    ttft = [r.times[0] - r.sent for r in ok]
    tpot = [(r.times[-1] - r.times[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
    e2e = [r.end - r.sent for r in ok]
    norm = [(r.end - r.sent) / r.tokens for r in ok]
    out_tokens = sum(r.tokens for r in ok)
    return {"completed": len(ok), "failed": len(recs) - len(ok), "wall_s": wall,
            "throughput_req_s": len(ok) / wall, "throughput_tok_s": out_tokens / wall,
            "ttft_s": _pct(ttft), "tpot_s": _pct(tpot), "itl_s": _pct(itl), "e2e_s": _pct(e2e),
            "normalized_latency_s_per_tok": _pct(norm),
            "errors": sorted({r.error for r in recs if r.error})[:5]}


def engine_kwargs(args) -> dict:
    return {"num_gpu_blocks": args.num_gpu_blocks, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "block_size": args.block_size}


def start_server(args, tmp: Path) -> tuple[subprocess.Popen, dict]:
    port_file = tmp / "ports.json"
    cmd = [sys.executable, "-m", "pagedjax", "serve", args.model, "--port", "0",
           "--grpc-port", "0", "--port-file", str(port_file)]
    for k, v in engine_kwargs(args).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    log = open(tmp / "server.log", "w")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None:
            raise RuntimeError((tmp / "server.log").read_text())
        time.sleep(0.1)
    ports = json.loads(port_file.read_text())
    from pagedjax.serving.client import Client

    with Client(f"127.0.0.1:{ports['port']}") as c:
        c.wait_ready(600)
    return proc, ports


def _remote_compiles(ports: dict) -> int:
    from pagedjax.serving.client import Client

    with Client(f"127.0.0.1:{ports['port']}") as c:
        return c.stats().num_compiles


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for j, proto in enumerate(result["protocols"]):
        rates = [p["rate"] for p in result["points"]]
        for stat, style in (("mean", "-o"), ("p90", "--x")):
            ys = [p[proto]["normalized_latency_s_per_tok"][stat] for p in result["points"]]
            ax.plot(rates, ys, style, color=f"C{j}", label=f"{proto} {stat}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{result['workload']} on {result['device']} ({result['model']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="alpaca")
    ap.add_argument("--rates", default="0.5,1,2", help="comma-separated req/s ('inf' allowed)")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per rate (upper bound)")
    ap.add_argument("--duration", type=float, default=None, help="cap each rate's arrivals at this many s")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the workload's mean lengths")
    ap.add_argument("--num-gpu-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="requests in the initial untimed burst")
    ap.add_argument("--warmup-passes", type=int, default=0,
                    help="run each rate's requests this many times untimed before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--protocols", default="grpc,inprocess", help="any of grpc, http, inprocess")
    ap.add_argument("--tag", default=None, help="results file suffix (default: workload)")
    args = ap.parse_args(argv)

    import jax

    from pagedjax.engine import LLMEngine
    from pagedjax.serving.async_engine import AsyncEngine

    dev = jax.devices()[0]
    device = "cpu" if dev.platform == "cpu" else dev.device_kind.lower().replace(" ", "_")
    protocols = args.protocols.split(",")
    eng = LLMEngine.from_model(args.model, None, **engine_kwargs(args))
    vocab = eng.model_config.vocab_size
    aeng = AsyncEngine(eng).start() if "inprocess" in protocols else None
    tmp = Path(tempfile.mkdtemp(prefix="pagedjax-bench-"))
    remote = {"grpc", "http"} & set(protocols)
    proc, ports = start_server(args, tmp) if remote else (None, {})
    runners = {"grpc": lambda reqs: run_grpc(f"127.0.0.1:{ports['port']}", reqs),
               "http": lambda reqs: run_http(f"http://127.0.0.1:{ports.get('http_port')}", reqs),
               "inprocess": lambda reqs: run_inprocess(aeng, reqs)}
    compiles = {"grpc": lambda: _remote_compiles(ports), "http": lambda: _remote_compiles(ports),
                "inprocess": lambda: eng.get_stats().num_compiles}
    points = []
    try:
        warm = make_requests(args.workload, args.warmup, math.inf, vocab_size=vocab,
                             max_model_len=args.max_model_len, scale=args.scale, seed=args.seed + 999)
        for proto in protocols:
            asyncio.run(runners[proto](warm))
        for k, rate in enumerate(float(r) for r in args.rates.split(",")):
            reqs = make_requests(args.workload, args.num_requests, rate, vocab_size=vocab,
                                 max_model_len=args.max_model_len, scale=args.scale, seed=args.seed + k)
            if args.duration is not None:
                reqs = [r for r in reqs if r.arrival <= args.duration] or reqs[:1]
            point = {"rate": rate, "workload_stats": describe(reqs)}
            order = protocols[k % len(protocols):] + protocols[: k % len(protocols)]  # rotate: no fixed bias
            for proto in order:
                for _ in range(args.warmup_passes):  # same requests, untimed: compile their shapes
                    asyncio.run(runners[proto](reqs))
                c0 = compiles[proto]()
                point[proto] = summarize(*asyncio.run(runners[proto](reqs)))
                point[proto]["num_compiles_during_run"] = compiles[proto]() - c0
                point[proto]["load_avg_1m_after"] = os.getloadavg()[0]  # other jobs on the host skew CPU runs
                nl = point[proto]["normalized_latency_s_per_tok"]["mean"]
                print(f"rate {rate:g} {proto}: {point[proto]['completed']} done, "
                      f"{point[proto]['throughput_tok_s']:.1f} tok/s, norm latency {nl}", flush=True)
            base = point.get("inprocess", {}).get("normalized_latency_s_per_tok", {}).get("mean")
            for proto in remote:
                g = point[proto]["normalized_latency_s_per_tok"]["mean"]
                point[f"{proto}_overhead_pct"] = None if not g or not base else 100.0 * (g / base - 1.0)
            points.append(point)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        if aeng is not None:
            aeng.shutdown()
    result = {"workload": args.workload, "workload_source": WORKLOADS[args.workload].source,
              "model": args.model, "device": device, "scale": args.scale, "engine": engine_kwargs(args),
              "protocols": protocols, "cpu_count": os.cpu_count(), "points": points,
              "note": "CPU runs are smoke tests of the harness, not a serving-performance claim: the "
                      "server and the in-process engine share a few CPU cores with whatever else runs on the "
                      "host (see load_avg_1m_after), and shapes not seen in warm-up still compile mid-run."
              if device == "cpu" else ""}
    out = RESULTS / device
    out.mkdir(parents=True, exist_ok=True)
    stem = f"serve_{args.tag or args.workload}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
