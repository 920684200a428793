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


AIPERF = Path(__file__).resolve().parents[1] / ".venv-aiperf" / "bin" / "aiperf"


def run_aiperf(base_url: str, reqs: list[Request], tok_dir: Path, model: str, tmp: Path,
               aiperf: Path = AIPERF) -> dict:
    """The same arrivals and lengths driven by NVIDIA's `aiperf` (a client no test here
    wrote): a mooncake-style trace (timestamp, input and output length per request) replayed
    on its fixed schedule against /v1/completions, streamed, EOS ignored. aiperf makes its own
    prompts of those lengths from the tokenizer, so token ids differ from ours; lengths and
    arrival times are the same. Returns its metrics in this script's units (seconds)."""
    tag = uuid.uuid4().hex[:8]
    trace = tmp / f"trace-{tag}.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(round(r.arrival * 1000)),
                                         "input_length": len(r.prompt_token_ids),
                                         "output_length": r.output_len}) + "\n" for r in reqs))
    art = tmp / f"aiperf-{tag}"
    cmd = [str(aiperf), "profile", "--model", model, "--url", base_url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tok_dir),
           "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", "temperature:0", "--use-legacy-max-tokens",
           "--artifact-dir", str(art), "--ui-type", "none"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    export = next(art.rglob("profile_export_aiperf.json"))
    return {"raw": json.loads(export.read_text()), "wall_s_with_startup": wall,
            "command": " ".join(cmd)}


def aiperf_summary(raw: dict) -> dict:
    """aiperf's export in `summarize`'s shape (ms -> s)."""
    def pct(key: str) -> dict:
        m = raw.get(key) or {}
        scale = 1e-3 if m.get("unit", "ms") == "ms" else 1.0
        return {k: (m[src] * scale if m.get(src) is not None else None)
                for k, src in (("mean", "avg"), ("p50", "p50"), ("p90", "p90"), ("p99", "p99"))}

    def val(key: str) -> float | None:
        m = raw.get(key) or {}
        return m.get("avg")

    osl = raw.get("output_sequence_length") or {}
    return {"completed": val("request_count"), "throughput_req_s": val("request_throughput"),
            # aiperf's throughput is over its benchmark duration (first sent to last answer).
            "throughput_tok_s": val("output_token_throughput"),
            "throughput_tok_s_span": val("output_token_throughput"),
            "span_s": val("benchmark_duration"), "output_tokens": osl.get("sum"),
            "mean_input_tokens": val("input_sequence_length"),
            "ttft_s": pct("time_to_first_token"), "itl_s": pct("inter_token_latency"),
            "e2e_s": pct("request_latency")}


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
    # First request sent to last response: the window aiperf's throughput uses.
    span = max((r.end for r in ok), default=0.0) - min((r.sent for r in ok), default=0.0)
    return {"completed": len(ok), "failed": len(recs) - len(ok), "wall_s": wall,
            "throughput_req_s": len(ok) / wall, "throughput_tok_s": out_tokens / wall,
            "span_s": span, "throughput_tok_s_span": out_tokens / span if span > 0 else None,
            "output_tokens": out_tokens,
            "ttft_s": _pct(ttft), "tpot_s": _pct(tpot), "itl_s": _pct(itl), "e2e_s": _pct(e2e),
            "normalized_latency_s_per_tok": _pct(norm),
            "errors": sorted({r.error for r in recs if r.error})[:5]}


def engine_kwargs(args) -> dict:
    return {"num_gpu_blocks": args.num_gpu_blocks, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "block_size": args.block_size}


def start_server(args, tmp: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    port_file = tmp / "ports.json"
    cmd = [sys.executable, "-m", "pagedjax", "serve", args.model, "--port", "0",
           "--grpc-port", "0", "--port-file", str(port_file), *extra]
    if not args.prefix_caching:
        # Every protocol and rep sends the same prompts to its server: hits would favour
        # whichever runs later. Off unless asked (the default since stop 57).
        cmd.append("--no-enable-prefix-caching")
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
    """TTFT and inter-token latency (p50, with p90 dashed) and throughput per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    rates = [p["rate"] for p in result["points"]]
    for j, proto in enumerate(result["protocols"]):
        for ax, key in zip(axes[:2], ("ttft_s", "itl_s")):
            for stat, style in (("p50", "-o"), ("p90", "--x")):
                ys = [p[proto][key][stat] for p in result["points"]]
                ax.plot(rates, ys, style, color=f"C{j}", label=f"{proto} {stat}")
        axes[2].plot(rates, [p[proto]["throughput_tok_s"] for p in result["points"]], "-o",
                     color=f"C{j}", label=proto)
    for ax, label in zip(axes, ("time to first token (s)", "inter-token latency (s)",
                                "output tokens/s")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['workload']} on {result['device']} ({result['model']})", fontsize=9)
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
    ap.add_argument("--prefix-caching", action="store_true",
                    help="leave the servers' prefix caching on (their default): repeated "
                         "prompts then hit the cache")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="requests in the initial untimed burst")
    ap.add_argument("--warmup-passes", type=int, default=0,
                    help="run each rate's requests this many times untimed before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--protocols", default="grpc,inprocess",
                    help="any of grpc, http, inprocess, aiperf (NVIDIA's aiperf over HTTP, from "
                         ".venv-aiperf: `make aiperf-venv`), grpc-engine-process (a second "
                         "server, `pagedjax serve --engine-process`)")
    ap.add_argument("--reps", type=int, default=1,
                    help="repeat each rate's protocols this many times, rotating their order "
                         "(A,B,A,B): every rep is kept in the JSON")
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
    remote = {"grpc", "http", "aiperf", "grpc-engine-process"} & set(protocols)
    proc, ports = start_server(args, tmp) if remote - {"grpc-engine-process"} else (None, {})
    # The same server with its engine in a child process (`pagedjax serve --engine-process`).
    proc2, ports2 = (start_server(args, tmp / "engine-process", "--engine-process")
                     if "grpc-engine-process" in protocols else (None, {}))
    runners = {"grpc": lambda reqs: run_grpc(f"127.0.0.1:{ports['port']}", reqs),
               "grpc-engine-process": lambda reqs: run_grpc(f"127.0.0.1:{ports2['port']}", reqs),
               "http": lambda reqs: run_http(f"http://127.0.0.1:{ports.get('http_port')}", reqs),
               "inprocess": lambda reqs: run_inprocess(aeng, reqs)}
    compiles = {"grpc": lambda: _remote_compiles(ports), "http": lambda: _remote_compiles(ports),
                "grpc-engine-process": lambda: _remote_compiles(ports2),
                "aiperf": lambda: _remote_compiles(ports),
                "inprocess": lambda: eng.get_stats().num_compiles}
    tok_dir = tmp / "tokenizer"
    if "aiperf" in protocols:  # aiperf builds its prompts with the model's tokenizer
        eng.tokenizer.save_pretrained(tok_dir)
    points = []
    try:
        warm = make_requests(args.workload, args.warmup, math.inf, vocab_size=vocab,
                             max_model_len=args.max_model_len, scale=args.scale, seed=args.seed + 999)
        for proto in protocols:  # aiperf's server is warmed by the http runner
            asyncio.run(runners["http" if proto == "aiperf" else proto](warm))
        for k, rate in enumerate(float(r) for r in args.rates.split(",")):
            reqs = make_requests(args.workload, args.num_requests, rate, vocab_size=vocab,
                                 max_model_len=args.max_model_len, scale=args.scale, seed=args.seed + k)
            if args.duration is not None:
                reqs = [r for r in reqs if r.arrival <= args.duration] or reqs[:1]
            point = {"rate": rate, "workload_stats": describe(reqs)}
            point["reps"] = []
            for rep in range(args.reps):
                j = k + rep  # rotate the order every rep and rate: no fixed bias (A,B / B,A)
                order = protocols[j % len(protocols):] + protocols[: j % len(protocols)]
                runs = {}
                for proto in order:
                    for _ in range(args.warmup_passes):  # same requests, untimed: compile shapes
                        asyncio.run(runners[proto if proto != "aiperf" else "http"](reqs))
                    c0 = compiles[proto]()
                    load0 = os.getloadavg()[0]
                    if proto == "aiperf":
                        got = run_aiperf(f"http://127.0.0.1:{ports['http_port']}", reqs, tok_dir,
                                         args.model, tmp)
                        runs[proto] = {**aiperf_summary(got["raw"]), "command": got["command"]}
                    else:
                        runs[proto] = summarize(*asyncio.run(runners[proto](reqs)))
                    runs[proto]["num_compiles_during_run"] = compiles[proto]() - c0
                    # Other jobs on the host skew CPU runs: the load before and after.
                    runs[proto]["load_avg_1m_before"] = load0
                    runs[proto]["load_avg_1m_after"] = os.getloadavg()[0]
                    print(f"rate {rate:g} rep {rep} {proto}: {runs[proto]['completed']} done, "
                          f"{runs[proto]['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                          f"{runs[proto]['ttft_s']['p50']}, ITL p50 {runs[proto]['itl_s']['p50']}",
                          flush=True)
                point["reps"].append(runs)
            for proto in protocols:  # the headline: the median rep by throughput
                ranked = sorted(point["reps"], key=lambda r, p=proto: r[p]["throughput_tok_s"] or 0)
                point[proto] = ranked[len(ranked) // 2][proto]
            base = point.get("inprocess", {}).get("normalized_latency_s_per_tok", {}).get("mean")
            for proto in remote - {"aiperf"}:
                g = point[proto]["normalized_latency_s_per_tok"]["mean"]
                point[f"{proto}_overhead_pct"] = None if not g or not base else 100.0 * (g / base - 1.0)
            if {"aiperf", "http"} <= set(protocols):  # two clients, one server: do they agree?
                point["aiperf_vs_http"] = {
                    m: [r["aiperf"][key]["p50"] / r["http"][key]["p50"]
                        if r["aiperf"][key]["p50"] and r["http"][key]["p50"] else None
                        for r in point["reps"]]
                    for m, key in (("ttft_p50_ratio", "ttft_s"), ("itl_p50_ratio", "itl_s"),
                                   ("e2e_p50_ratio", "e2e_s"))}
                point["aiperf_vs_http"]["throughput_ratio"] = [
                    r["aiperf"]["throughput_tok_s_span"] / r["http"]["throughput_tok_s_span"]
                    for r in point["reps"] if r["http"]["throughput_tok_s_span"]]
            points.append(point)
    finally:
        for p in (proc, proc2):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                p.wait(120)
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
