"""The compile tier's report: one JSON per target, and the checks `make test` applies to it."""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import jax

from pagedjax.aot import fingerprint, kernel_sweep, step
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
          reuse: dict | None = None, compile_kernel=True, compile_step=True) -> dict:
    """Compile the kernel sweep and the engine steps for ``target``; the whole report.

    ``reuse``: a previous report; if its toolchain is today's, its kernel entries whose IR
    digests match are kept instead of compiled again. ``compile_kernel`` / ``compile_step``:
    predicates (or bools) on a kernel key / step row; what they refuse is lowered only
    (:func:`verify`). A report built with either refusing anything is not summarized."""
    fingerprint.strip_locations()
    report = dict(
        target=target, device_kind=compile_only_devices(target)[0].device_kind,
        sm=sm_version(target), smem_limit=smem_limit(target), **fingerprint.toolchain(target),
        host=f"{platform.machine()} {platform.system()}, deviceless (JAX_PLATFORMS=cpu)",
        date=datetime.date.today().isoformat(),
        reproduce=f"make aot-report TARGETS={target}",
    )
    if reuse is not None and toolchain_changes(reuse, report):
        log(f"  {target}: toolchain changed ({'; '.join(toolchain_changes(reuse, report))}),"
            " compiling everything")
        reuse = None
    if kernels:
        report["kernels"] = kernel_sweep.sweep(
            target, log=log, reuse=(reuse or {}).get("kernels"), compile=compile_kernel)
    if steps:
        mixed = ("decode_b64", "mixed_512+63")
        report["steps"] = []
        for model, tps in STEP_PLAN[target]:
            for tp in tps:
                shapes = None if tp == 1 else [s for s in step.step_shapes(4096)
                                               if s.name in mixed]
                report["steps"] += step.compile_step(model, target, tp=tp, shapes=shapes, log=log,
                                                     compile=compile_step)
            report["steps"] += step.compile_swap(model, target, log=log)
        for model, kv in KV_STEP_PLAN[target]:
            shapes = [s for s in step.step_shapes(4096) if s.name in mixed]
            report["steps"] += step.compile_step(model, target, shapes=shapes, log=log,
                                                 kv_cache_dtype=kv, compile=compile_step)
    if compile_kernel is True and compile_step is True:
        report["summary"] = summarize(report)
    return report


def toolchain_changes(committed: dict, fresh: dict) -> list[str]:
    """How two reports' toolchains differ (compiler versions, target config)."""
    a, b = committed.get("versions", {}), fresh.get("versions", {})
    out = [f"{p} {a.get(p)} -> {b.get(p)}" for p in sorted(a.keys() | b.keys())
           if a.get(p) != b.get(p)]
    if committed.get("target_config_sha") != fresh.get("target_config_sha"):
        out.append("target config " + str(committed.get("target_config_sha")) + " -> "
                   + str(fresh.get("target_config_sha")))
    return out


# The sample the check compiles (beyond the lowering of everything): the kernels nearest
# the register and shared-memory limits, every SAMPLE_STRIDE-th entry of the sweep, and
# engine steps of every model, TP degree and cache dtype kind.
SAMPLE_NEAREST = 8
SAMPLE_STRIDE = 40
STEP_SAMPLE = (("smollm2-135m", 1, "auto", "decode_b1"), ("llama3-8b", 1, "auto", "decode_b256"),
               ("llama3-8b", 1, "auto", "mixed_512+63"), ("llama3-8b", 8, "auto", "mixed_512+63"),
               ("gemma2-9b", 1, "auto", "decode_b1"), ("gemma2-9b", 1, "auto", "mixed_512+63"),
               ("llama3-8b", 1, "int8", "mixed_512+63"), ("llama3-8b", 1, "fp8_e4m3", "decode_b64"))


def kernel_sample(committed: dict) -> set[tuple]:
    """Keys of the committed kernel entries the check compiles again."""
    compiled = committed["kernels"]["compiled"]

    def worst(c, f):
        return max((f(k) for r in c["rows"] for k in r["kernels"]), default=0)

    by_regs = sorted(compiled, key=lambda c: -worst(c, lambda k: k["registers"]))
    by_smem = sorted(compiled, key=lambda c: -worst(
        c, lambda k: k["static_smem"] + k["dynamic_smem"]))
    picked = by_regs[:SAMPLE_NEAREST] + by_smem[:SAMPLE_NEAREST] + compiled[::SAMPLE_STRIDE]
    return {tuple(c["key"]) for c in picked}


def step_sampled(row: dict) -> bool:
    return (row["model"], row["tp"], row.get("kv_cache_dtype", "auto"), row["shape"]) in \
        STEP_SAMPLE


def verify(target: str, committed: dict, log=print) -> list[str]:
    """Whether ``committed`` is what today's code compiles, without compiling all of it:
    the same toolchain, every configuration and step lowering to the IR digest the report
    names (so its compile is the recorded one), and a sample compiled again to the recorded
    resources. Returns the differences (empty: the report stands)."""
    changed = toolchain_changes(committed, fingerprint.toolchain(target))
    if changed:  # before lowering anything: the digests would prove nothing
        return [f"toolchain: {c}" for c in changed]
    fresh = build(target, log=log, compile_kernel=kernel_sample(committed).__contains__,
                  compile_step=step_sampled)
    return differences(project(committed, fresh), fresh)


def project(committed: dict, fresh: dict) -> dict:
    """``committed`` with the compile results blanked where ``fresh`` only lowered."""
    out = json.loads(json.dumps(committed))
    for c, f in zip(out.get("kernels", {}).get("compiled", []),
                    fresh.get("kernels", {}).get("compiled", [])):
        for r, fr in zip(c["rows"], f["rows"]):
            if fr["kernels"] is None:
                r["kernels"] = None
    for s, fs in zip(out.get("steps", []), fresh.get("steps", [])):
        if fs["error"] is None and fs["kernels"] is None:
            s.update(dict.fromkeys(step.STEP_COMPILE_FIELDS))
    return out


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
            ir=r.get("ir"), kernels=None if r["kernels"] is None else
            [{k: v for k, v in kr.items() if k != "grid"} for kr in r["kernels"]])
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
