"""Where a decode step's device time goes: whole Llama-3-8B decode steps traced with the
profiler, under XLA's default command buffers (CUDA graphs) and without them.

    python3 bench/gpu_step_profile.py --out $OUT/step_profile.json      # on a lent GPU
    .venv/bin/python bench/gpu_step_profile.py --model tiny --out F      # harness check on CPU

The seventh H200 run (2026-11-30, docs/gpu.md) timed the weight-only matmul chain of all 32
layers and the head at 4.43 ms for one row, and the whole batch-1 step at 5.9-6.2 ms. The
rest is attention, norms, rotary embeddings, KV writes and ~500 small kernels: either their
own time or gaps between their launches, which CUDA graphs shrink. Per variant
(``--variants``, each a set of XLA flags run in a child process of its own, since XLA reads
its flags once per process):

- ``sync_ms``: a step per call with a wait after each (as the e2e stage times it);
- ``pipelined_ms``: steps dispatched back to back (`bench.kernels.bench`), the device's time;
- from a profiler trace of ``--steps`` back-to-back steps, parsed in-process
  (`jax.profiler.ProfileData`): per step, the device's busy time (the union of its kernel
  and copy events), their count, the span from the first to the last event, the gap
  (span - busy), and the kernels with the most time, names with trailing numbers merged
  (``fusion_12`` and ``fusion_40`` are one class). XLA runs op by op while a profiler is
  active (`default`, `no_command_buffers`: the kernels' own time and the gaps without
  graphs) unless `--xla_enable_command_buffers_during_profiling` says otherwise
  (`graphs_in_trace`: the gaps with graphs); `default` against `no_command_buffers`
  untraced says what the graphs save.

The default variant also dumps XLA's thunk sequences (``--xla_dump_to``; `thunks`: per dump
file, the largest three, how often each thunk kind appears, those nested in a command buffer
included, so `kCommandBuffer` 1 and `kCustomKernel` 646 is one graph of 646 kernels). The
variants run one after the other (each child builds its engine: ~1 min at 8B shapes), not
interleaved; a child past ``--child-timeout-s`` is stopped and its row says so. The JSON
records device, versions, the flags each child saw and the load average.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> XLA flags added to the environment's XLA_FLAGS. XLA runs op by op while a profiler
# is on unless told otherwise (`graphs_in_trace`); an unknown flag aborts only its child.
VARIANTS = {
    "default": "",
    "no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "graphs_in_trace": "--xla_enable_command_buffers_during_profiling=true",
}
# What the default variant's thunk-sequence dump is searched for: graphs, and what runs
# outside them.
THUNK_KINDS = ("kCommandBuffer", "kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul",
               "kConditional", "kWhile", "kCustomCall", "kCopy", "kMemset32BitValue",
               "kMemzero")
# Derived timelines the profiler adds beside a GPU's raw stream lines: the same time again.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source", "TensorFlow")


def kernel_class(name: str) -> str:
    """A kernel name without its instance number: ``loop_add_fusion_3`` -> ``loop_add_fusion``."""
    return re.sub(r"([._]\d+)+$", "", name)


def busy_summary(events: list[tuple[str, int, int]], steps: int, top: int = 12) -> dict:
    """Per-step figures of device events ``(name, start_ns, duration_ns)`` over ``steps``
    steps: busy time (their union, so overlapping streams count once), count, span, gap."""
    if not events:
        return {"events_per_step": 0, "busy_ms": 0.0, "span_ms": 0.0, "gap_ms": 0.0, "top": []}
    spans = sorted((s, s + d) for _, s, d in events)
    busy, cur_s, cur_e = 0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in spans) - spans[0][0]
    by_class: dict[str, list[int]] = {}
    for name, _, d in events:
        c = by_class.setdefault(kernel_class(name), [0, 0])
        c[0] += 1
        c[1] += d
    ranked = sorted(by_class.items(), key=lambda kv: -kv[1][1])[:top]
    return {"events_per_step": len(events) / steps, "busy_ms": busy / steps / 1e6,
            "span_ms": span / steps / 1e6, "gap_ms": (span - busy) / steps / 1e6,
            "top": [{"kernel": k, "per_step": n / steps, "ms": d / steps / 1e6}
                    for k, (n, d) in ranked]}


def device_events(xplane_path: str) -> list[tuple[str, int, int]]:
    """Kernel and copy events of the accelerator planes of a trace file; on a CPU (the
    harness check), XLA's execution threads stand in for a device."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane_path)
    out: list[tuple[str, int, int]] = []
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    for plane in gpu:
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")]
        if not lines:
            lines = [ln for ln in plane.lines if not ln.name.startswith(_DERIVED_LINES)]
        for ln in lines:
            out.extend((e.name, int(e.start_ns), int(e.duration_ns)) for e in ln.events)
    if not gpu:
        for plane in data.planes:
            if plane.name == "/host:CPU":
                for ln in plane.lines:
                    if ln.name.startswith("tf_XLAExecute"):
                        out.extend((e.name, int(e.start_ns), int(e.duration_ns))
                                   for e in ln.events)
    return out


def thunk_summary(dump_dir: str, top: int = 3) -> dict:
    """Counts of thunk kinds (nested ones included) in XLA's thunk-sequence dumps
    (``--xla_dump_to``) for the ``top`` largest files (the step's shapes), and the largest
    file's head for reading: which launches a command buffer holds and which run bare."""
    files = sorted(glob.glob(f"{dump_dir}/**/*thunk_sequence*", recursive=True),
                   key=os.path.getsize, reverse=True)
    res: dict = {"files": [Path(f).name for f in files][:20]}
    if files:
        res["largest"] = Path(files[0]).name
        res["counts"] = {}
        for f in files[:top]:
            text = Path(f).read_text(errors="replace")
            res["counts"][Path(f).name] = {k: len(re.findall(rf"\b{k}\b", text))
                                           for k in THUNK_KINDS}
        res["head"] = Path(files[0]).read_text(errors="replace")[:6000]
    return res


def child(model: str, points: list[tuple[int, int]], steps: int, iters: int) -> dict:
    """One variant in this process: build the engine, time and trace each point."""
    import jax
    import jax.numpy as jnp

    from bench.gpu_suite.seeded import SPECS, NoTokenizer, device_random_params
    from bench.gpu_suite.stage_e2e import _decode_step_ms, decode_step_inputs
    from pagedjax import LLM

    on_cpu = jax.devices()[0].platform == "cpu"
    cfg = SPECS[model].config
    t0 = time.monotonic()
    params = device_random_params(cfg, SPECS[model].seed, jnp.bfloat16)
    b_max = max(b for b, _ in points)
    blocks = sum(b * -(-c // 16) for b, c in points) + 16
    llm = LLM.from_params(cfg, params, NoTokenizer(), attention_backend="xla" if on_cpu else "pallas",
                          block_size=16, num_gpu_blocks=blocks, max_num_seqs=max(8, b_max),
                          max_num_batched_tokens=512, max_model_len=max(c for _, c in points) + 64,
                          warmup=False, enable_prefix_caching=False)
    runner = llm.engine.runner
    res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "xla_flags_seen": os.environ.get("XLA_FLAGS", ""),
                 "setup_s": time.monotonic() - t0, "points": []}
    for b, c in points:
        row = {"batch": b, "context": c,
               "sync_ms": _decode_step_ms(runner, b, c, iters) * 1e3,
               "pipelined_ms": _decode_step_ms(runner, b, c, iters, pipelined=True) * 1e3}
        inputs = decode_step_inputs(runner, b, c)
        with tempfile.TemporaryDirectory() as d:
            jax.block_until_ready(runner.execute(inputs))
            jax.profiler.start_trace(d)
            out = None
            for _ in range(steps):
                out = runner.execute(inputs)
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
            row["trace"] = busy_summary(device_events(files[0]), steps) if files else None
        res["points"].append(row)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_8b", help="a bench.gpu_suite.seeded spec")
    ap.add_argument("--points", default="1x1024,64x1024", help="BATCHxCONTEXT, comma list")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=5, help="steps in each trace")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--child-timeout-s", type=float, default=420,
                    help="a variant's process is stopped past this (its row records why)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a variant's process: write JSON here
    args = ap.parse_args(argv)
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    if args.child:
        Path(args.child).write_text(json.dumps(child(args.model, points, args.steps, args.iters)))
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; expected some of {', '.join(VARIANTS)}")
    # No jax in this process: each child gets the whole device.
    res: dict = {"what": __doc__.splitlines()[0], "model": args.model,
                 "command": " ".join(["python3 bench/gpu_step_profile.py", *(argv or sys.argv[1:])]),
                 "python": platform.python_version(), "load_avg_1m_at_start": os.getloadavg()[0],
                 "steps": args.steps, "iters": args.iters, "variants": {}}
    for v in variants:
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {VARIANTS[v]}".strip()
        t0 = time.monotonic()
        with tempfile.NamedTemporaryFile(suffix=".json") as f, tempfile.TemporaryDirectory() as dump:
            if v == "default":  # the thunk sequence: what the command buffers hold
                env["XLA_FLAGS"] += f" --xla_dump_to={dump}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model,
                   "--points", args.points, "--steps", str(args.steps), "--iters",
                   str(args.iters), "--out", args.out, "--child", f.name]
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=args.child_timeout_s)
                row = (json.loads(Path(f.name).read_text()) if p.returncode == 0
                       else {"error": p.stderr[-3000:]})
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
                row = {"error": f"stopped after {args.child_timeout_s:.0f} s\n{(err or '')[-3000:]}"}
            if v == "default":
                row["thunks"] = thunk_summary(dump)
        row.update(xla_flags=env["XLA_FLAGS"], elapsed_s=time.monotonic() - t0)
        res["variants"][v] = row
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        for pt in row.get("points", []):
            tr = pt["trace"] or {}
            print(f"{v:<20} b{pt['batch']} ctx{pt['context']}: sync {pt['sync_ms']:.2f} ms, "
                  f"pipelined {pt['pipelined_ms']:.2f} ms; trace per step: busy "
                  f"{tr.get('busy_ms', 0):.2f} ms, span {tr.get('span_ms', 0):.2f}, gap "
                  f"{tr.get('gap_ms', 0):.2f}, {tr.get('events_per_step', 0):.0f} events")
            for t in tr.get("top", [])[:8]:
                print(f"    {t['ms']:.3f} ms  x{t['per_step']:.0f}  {t['kernel'][:90]}")
        for name, counts in row.get("thunks", {}).get("counts", {}).items():
            print(f"{v:<20} thunk sequence {name}: "
                  f"{ {k: n for k, n in counts.items() if n} }")
        if "error" in row:
            print(f"{v}: FAILED\n{row['error']}")
    return 0 if all("error" not in r for r in res["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
