"""The compile tier's report: one JSON per target, and the checks `make test` applies to it."""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import platform
import re
from pathlib import Path

import jax

from pagedjax.aot import kernel_sweep, step
from pagedjax.aot.target import compile_only_devices, sm_version, target_config

REPORT_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
# Step compiles per target: (model, tensor-parallel degrees). TP > 1 runs on an abstract
# one-host N-GPU topology; A100 and B200 get the single-GPU steps only.
STEP_PLAN = {
    "h100": (("smollm2-135m", (1,)), ("llama3-8b", (1, 2, 4, 8)), ("gemma2-9b", (1,))),
    "a100": (("smollm2-135m", (1,)), ("llama3-8b", (1,))),
    "b200": (("llama3-8b", (1,)),),
}
# Quantized KV caches (issue 20): the engine step of a model with an int8 / FP8 cache, at the
# decode and mixed shapes (FP8 from sm_89: not on A100, where the engine refuses it).
KV_STEP_PLAN = {
    "h100": (("llama3-8b", "int8"), ("llama3-8b", "fp8_e4m3")),
    "a100": (("llama3-8b", "int8"),),
    "b200": (),
}


def report_path(target: str, root: Path = REPORT_DIR) -> Path:
    return root / f"aot-{target}" / "report.json"


def smem_limit(target: str) -> int:
    """Opt-in shared memory per block: what one launch may use."""
    return int(re.search(r"shared_memory_per_block_optin:\s*(\d+)", target_config(target))[1])


def build(target: str, kernels: bool = True, steps: bool = True, log=print,
          reuse: dict | None = None) -> dict:
    """Compile the kernel sweep and the engine steps for ``target``; the whole report.
    ``reuse``: a previous report whose compiled kernels are taken by key (`sweep`)."""
    versions = {p: md.version(p) for p in ("jax", "jaxlib", "jax-cuda13-plugin",
                                          "nvidia-cuda-nvcc", "nvidia-nvjitlink")}
    report = dict(
        target=target, device_kind=compile_only_devices(target)[0].device_kind,
        sm=sm_version(target), smem_limit=smem_limit(target), versions=versions,
        host=f"{platform.machine()} {platform.system()}, deviceless (JAX_PLATFORMS=cpu)",
        date=datetime.date.today().isoformat(),
        reproduce=f"make aot-report TARGETS={target}",
    )
    if kernels:
        report["kernels"] = kernel_sweep.sweep(
            target, log=log, reuse=(reuse or {}).get("kernels"))
    if steps:
        report["steps"] = []
        for model, tps in STEP_PLAN[target]:
            for tp in tps:
                shapes = None if tp == 1 else [s for s in step.step_shapes(4096)
                                               if s.name in ("decode_b64", "mixed_512+63")]
                report["steps"] += step.compile_step(model, target, tp=tp, shapes=shapes, log=log)
            report["steps"] += step.compile_swap(model, target, log=log)
        for model, kv in KV_STEP_PLAN[target]:
            shapes = [s for s in step.step_shapes(4096) if s.name in ("decode_b64", "mixed_512+63")]
            report["steps"] += step.compile_step(model, target, shapes=shapes, log=log,
                                                 kv_cache_dtype=kv)
    report["summary"] = summarize(report)
    return report


def summarize(report: dict) -> dict:
    out: dict = {}
    limit = report["smem_limit"]
    if "kernels" in report:
        rows = [(c["key"], r) for c in report["kernels"]["compiled"] for r in c["rows"]]
        ks = [k for _, r in rows for k in r["kernels"]]
        out.update(
            engine_configs=len(report["kernels"]["configs"]),
            distinct_kernels=len(report["kernels"]["compiled"]),
            compiles=len(rows),
            kernel_failures=[key for key, r in rows if r["error"]],
            kernels_spilling=sorted({k["name"] for k in ks if k["spill_stores"] + k["spill_loads"]}),
            kernels_over_smem=sorted({k["name"] for k in ks
                                      if k["static_smem"] + k["dynamic_smem"] > limit}),
            max_registers=max((k["registers"] for k in ks), default=0),
            max_smem=max((k["static_smem"] + k["dynamic_smem"] for k in ks), default=0),
            kernel_compile_s=round(sum(r["compile_s"] for _, r in rows), 1),
        )
    if "steps" in report:
        steps = report["steps"]
        out.update(
            steps=len(steps),
            step_failures=[f"{s['model']} tp={s['tp']} {s['shape']}" for s in steps
                           if s["error"] or s["sampler_error"]],
            steps_spilling=sorted({n for s in steps for n in s["spilling"] + s["sampler_spilling"]}),
            step_compile_s=round(sum(s["compile_s"] + s["sampler_compile_s"] for s in steps), 1),
        )
    return out


def problems(report: dict) -> list[str]:
    """Everything that fails the tier, as readable lines (empty: the target is clean)."""
    s = report["summary"]
    out = [f"compile failed: {k}" for k in s.get("kernel_failures", [])]
    out += [f"spills: {k}" for k in s.get("kernels_spilling", [])]
    out += [f"shared memory over {report['smem_limit']} B: {k}" for k in s.get("kernels_over_smem", [])]
    out += [f"step failed: {k}" for k in s.get("step_failures", [])]
    out += [f"step kernel spills: {k}" for k in s.get("steps_spilling", [])]
    return out


def comparable(report: dict) -> dict:
    """What must match between a fresh build and the committed report (no timings or dates):
    every engine configuration, its launch parameters, and each kernel's resources."""
    kernels = report.get("kernels", {})
    return dict(
        configs=kernels.get("configs", []),
        compiled=[dict(key=c["key"], rows=[dict(
            extra=r["extra"], error=bool(r["error"]),
            kernels=[{k: v for k, v in kr.items() if k != "grid"} for kr in r["kernels"]])
            for r in c["rows"]]) for c in kernels.get("compiled", [])],
        steps=[{k: v for k, v in s.items() if not k.endswith("compile_s") and k != "error"}
               for s in report.get("steps", [])],
    )


def differences(committed: dict, fresh: dict, most: int = 12) -> list[str]:
    """Short description of where two reports' `comparable` parts differ (for a test
    failure that says what changed instead of printing two 70k-line dicts)."""
    a, b = comparable(committed), comparable(fresh)
    out = []
    for section in a.keys() | b.keys():
        xs, ys = a.get(section, []), b.get(section, [])
        if len(xs) != len(ys):
            out.append(f"{section}: {len(xs)} committed vs {len(ys)} fresh entries")
        for i, (x, y) in enumerate(zip(xs, ys)):
            if x != y:
                keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
                out.append(f"{section}[{i}]: " + "; ".join(
                    f"{k}: {str(x.get(k))[:80]} -> {str(y.get(k))[:80]}" for k in keys))
    return out[:most]


def load(target: str, root: Path = REPORT_DIR) -> dict:
    """The committed report of ``target``."""
    return json.loads(report_path(target, root).read_text())


def write(report: dict, root: Path = REPORT_DIR) -> Path:
    path = report_path(report["target"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def check_backend() -> None:
    if jax.default_backend() != "cpu":
        raise RuntimeError("the compile tier runs deviceless: set JAX_PLATFORMS=cpu")
