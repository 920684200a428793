"""Compile tier for the Mosaic GPU kernels (`pallas_kernels.mosaic_decode_attention`,
`pallas_kernels.mosaic_ragged_attention`).

Every configuration the kernels accept is compiled deviceless for the H100 target: decode
over dtype x head dim (64, 128, 256: two column programs) x page size (the GQA group only
changes how many of the 64 query rows are real), ragged also over the padded group (1, 2, 4,
8: it sets the causal mask's rows; fp16 at group 4 only, its kernels differ from bf16's in
the element type alone), plus the windowed variants (bf16, groups 1 and 4), soft-capped
windowed ones (head dim 128) and int8 / FP8 e4m3 / e5m2 caches under bf16 queries (every
shape they serve; ragged at group 4), with ``MOSAIC_GPU_DUMP_PTXAS=1``, which makes Mosaic
GPU print ptxas' register and spill report to stdout. The driver runs the compiles in a
child process (the report is written by native code to file descriptor 1) and parses it;
SMEM is the kernel's scratch, computed from its shapes (ptxas reports only static SMEM).
Hopper only: the kernel issues wgmma, which sm_100 replaced. The report lives beside the
Triton one, ``bench/results/aot-h100/mosaic.json``, with each configuration's IR digest:
`make test` lowers all of them and compiles a sample (:func:`verify`).

    JAX_PLATFORMS=cpu .venv-aot/bin/python -m pagedjax.aot.mosaic --write
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = "h100"
SMEM_LIMIT = 227 * 1024
_MARK = "@@mosaic-config "
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def configs() -> list[dict]:
    from pallas_kernels import mosaic_decode_attention as m

    decode = [{"kernel": "mosaic_decode", "dtype": dt.name, "head_dim": d, "block_size": bs}
              for dt in m.DTYPES for d in m.HEAD_DIMS for bs in m.BLOCK_SIZES
              if m.shape_ok(d, bs, ragged=False)]
    ragged = [{"kernel": "mosaic_ragged", "dtype": dt.name, "head_dim": d, "block_size": bs,
               "group": g}
              for dt in m.DTYPES for d in m.HEAD_DIMS for bs in m.BLOCK_SIZES
              if m.shape_ok(d, bs, ragged=True)
              for g in ((1, 2, 4, 8) if dt.name == "bfloat16" else (4,))]
    # Windowed (the window is data; the flag a static variant) on bf16, and soft-capped
    # windowed kernels (Gemma 2's pair) at head dim 128.
    windowed = [{**c, "windowed": True} for c in decode + ragged
                if c["dtype"] == "bfloat16" and c.get("group", 1) in (1, 4)]
    capped = [{**c, "windowed": True, "softcap": 50.0} for c in decode + ragged
              if c["dtype"] == "bfloat16" and c["head_dim"] == 128
              and c["block_size"] in (16, 64) and c.get("group", 2) == 2]
    # Quantized caches under bf16 queries (the 1-byte pages widened in SMEM): every shape
    # they serve, ragged at group 4 (the group only sets the mask's rows).
    quantized = [{**c, "kv_dtype": kv} for kv in QUANT_KV for c in decode + ragged
                 if c["dtype"] == "bfloat16" and c.get("group", 4) == 4
                 and m.shape_ok(c["head_dim"], c["block_size"], ragged=c["kernel"] != "mosaic_decode",
                                quantized=True)]
    return decode + ragged + windowed + capped + quantized


QUANT_KV = ("int8", "float8_e4m3fn", "float8_e5m2")


def scratch_bytes(cfg: dict) -> int:
    """The kernel's SMEM scratch (see `mosaic_paged_decode`'s scratch_types)."""
    from pallas_kernels import mosaic_decode_attention as m

    d, rows, chunk = cfg["head_dim"], m.ROWS, m.chunk_tokens(cfg["block_size"])
    dv = d // m.col_parts(d)  # V ring and output tile: the program's columns
    half = 2  # bf16 / fp16
    ring = 1 if "kv_dtype" in cfg else half  # a quantized cache's rings hold 1-byte values
    staging = chunk * (d + dv) * half if "kv_dtype" in cfg else 0  # ... widened here
    stats = 2 * rows * 4 if cfg["kernel"] == "mosaic_decode" else 0
    return (rows * d * half + m.STAGES * chunk * (d + dv) * ring + staging
            + rows * chunk * half + rows * dv * 4 + stats + 8 * (1 + 2 * m.STAGES))


def _compile_all(only: set[int] | None) -> None:
    """Child: lower every configuration and compile those in ``only`` (None: all), a
    marker line before each."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from pagedjax.aot import fingerprint
    from pagedjax.aot.target import compile_only_devices
    from pallas_kernels.mosaic_decode_attention import mosaic_paged_decode
    from pallas_kernels.mosaic_ragged_attention import mosaic_ragged_attention

    fingerprint.strip_locations()
    dev = compile_only_devices(TARGET)[0]
    for i, cfg in enumerate(configs()):
        print(_MARK + json.dumps(cfg), flush=True)
        dt, d, bs = jnp.dtype(cfg["dtype"]), cfg["head_dim"], cfg["block_size"]

        def S(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))

        t0 = time.perf_counter()
        ir, compiled = None, only is None or i in only
        try:
            cache = S((2, 8, 1024, bs, d), jnp.dtype(cfg.get("kv_dtype", cfg["dtype"])))
            i32 = jnp.int32
            with jax.default_device(dev):
                flags = dict(windowed=cfg.get("windowed", False), softcap=cfg.get("softcap"))
                # the static scales of a quantized cache: the argument after the window
                scales = (S((2, 8, d), jnp.float32),) if "kv_dtype" in cfg else ()
                if cfg["kernel"] == "mosaic_decode":
                    lowered = jax.jit(
                        lambda *a, f=flags: mosaic_paged_decode(*a, scale=0.1, **f)).lower(
                        S((8, 32, d), dt), cache, cache, S((8, 64), i32), S((8,), i32),
                        S((), i32), S((), i32), *scales)
                else:
                    lowered = jax.jit(
                        lambda *a, f=flags: mosaic_ragged_attention(*a, scale=0.1, **f)).lower(
                        S((256, 8 * cfg["group"], d), dt), cache, cache, S((16,), i32),
                        S((16, 64), i32), S((17,), i32), S((), i32), S((), i32),
                        S((), i32), *scales)
                ir = fingerprint.digest(lowered)
                if compiled:
                    lowered.compile()
            err = None
        except Exception as e:  # noqa: BLE001 - reported per configuration
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        sys.stdout.flush()
        print(_MARK + json.dumps({"done": round(time.perf_counter() - t0, 2), "error": err,
                                  "ir": ir, "compiled": compiled}), flush=True)


def build(only: set[int] | None = None) -> dict:
    """Lower every configuration in a child process, compile those in ``only`` (None: all)
    and parse its ptxas report: one row per configuration, with its IR digest
    (`pagedjax.aot.fingerprint`); a row only lowered has ``registers`` and ``spill_bytes``
    None. Summarized only when everything was compiled."""
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", JAX_PLATFORMS="cpu")
    env.pop("MOSAIC_GPU_DUMP_PTX", None)
    env.pop("MOSAIC_GPU_DUMP_TO", None)
    cmd = [sys.executable, "-m", "pagedjax.aot.mosaic", "--child"]
    if only is not None:
        cmd += ["--only", ",".join(map(str, sorted(only)))]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          errors="replace", timeout=1200)
    rows, cur = [], None
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            info = json.loads(line[len(_MARK):])
            if "done" in info:
                cur.update(ir=info["ir"], compile_s=info["done"], error=info["error"])
                if not info["compiled"] and not info["error"]:
                    cur.update(registers=None, spill_bytes=None)
                rows.append(cur)
                cur = None
            else:
                cur = {**info, "registers": None, "spill_bytes": 0,
                       "smem_bytes": scratch_bytes(info)}
        elif cur is not None:
            if (m := _USED.search(line)) is not None:
                cur["registers"] = max(cur["registers"] or 0, int(m.group(1)))
            if (m := _SPILL.search(line)) is not None:
                cur["spill_bytes"] += int(m.group(2)) + int(m.group(3))
    if proc.returncode != 0 or len(rows) != len(configs()):
        raise RuntimeError(f"mosaic compile child failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    if only is not None:
        return {"target": TARGET, "rows": rows}
    return {"target": TARGET, "rows": rows, "summary": {
        "configs": len(rows),
        "failures": [r for r in rows if r["error"]],
        "spilling": [r for r in rows if r["spill_bytes"]],
        "no_ptxas_report": [r for r in rows if r["registers"] is None and not r["error"]],
        "over_smem": [r for r in rows if r["smem_bytes"] > SMEM_LIMIT],
        "max_registers": max((r["registers"] or 0) for r in rows),
        "max_smem": max(r["smem_bytes"] for r in rows)}}


# The check's sample: the configurations nearest the register and SMEM limits and every
# SAMPLE_STRIDE-th one; the rest are checked by IR digest.
SAMPLE_NEAREST = 6
SAMPLE_STRIDE = 12


def sample(committed: dict) -> set[int]:
    rows = committed["rows"]
    by_regs = sorted(range(len(rows)), key=lambda i: -(rows[i]["registers"] or 0))
    by_smem = sorted(range(len(rows)), key=lambda i: -rows[i]["smem_bytes"])
    return set(by_regs[:SAMPLE_NEAREST] + by_smem[:SAMPLE_NEAREST]
               + list(range(0, len(rows), SAMPLE_STRIDE)))


def stable(rows: list[dict]) -> list[dict]:
    """The rows without timings (what the committed report keeps)."""
    return [{k: v for k, v in r.items() if k != "compile_s"} for r in rows]


def verify(committed: dict) -> list[str]:
    """Whether the committed report is what today's code compiles: every configuration
    lowers to the recorded IR digest and the sample compiles to the recorded registers and
    spills, with the compilers the report was built with. Returns the differences (empty:
    it stands)."""
    from pagedjax.aot import fingerprint, report

    changed = report.toolchain_changes(committed, fingerprint.toolchain(TARGET))
    if changed:
        return [f"toolchain: {c}" for c in changed]
    picked = sample(committed)
    return compare(committed["rows"], build(picked)["rows"], picked)


def compare(committed: list[dict], fresh: list[dict], picked: set[int]) -> list[str]:
    """Rows of a check build (``picked`` compiled, the rest lowered) that differ from the
    committed ones: any IR digest or configuration, and the compiled rows' resources."""
    old, new = stable(committed), stable(fresh)
    if len(old) != len(new):
        return [f"{len(old)} committed configurations vs {len(new)} now"]
    out = []
    for i, (a, b) in enumerate(zip(old, new)):
        if i not in picked and b["registers"] is None:
            a = dict(a, registers=None, spill_bytes=None)
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            out.append(f"rows[{i}] {b['kernel']} d{b['head_dim']} bs{b['block_size']}: "
                       + "; ".join(f"{k}: {a.get(k)} -> {b.get(k)}" for k in keys))
    return out


def report_path() -> Path:
    return ROOT / "bench" / "results" / f"aot-{TARGET}" / "mosaic.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true", help="write the committed report")
    args = ap.parse_args()
    if args.child:
        _compile_all(None if args.only is None else {int(x) for x in args.only.split(",")})
        return
    res = build()
    for r in res["rows"]:
        print(f"  {r['kernel']} {r['dtype']} d{r['head_dim']} bs{r['block_size']} "
              f"g{r.get('group', '-')}{' w' if r.get('windowed') else ''}"
              f"{' cap' if r.get('softcap') else ''}: registers {r['registers']}, "
              f"spills {r['spill_bytes']} B, smem {r['smem_bytes']} B, {r['compile_s']} s"
              f"{'  ERROR ' + r['error'] if r['error'] else ''}")
    print(json.dumps({k: v for k, v in res["summary"].items()}, default=str))
    if args.write:
        from pagedjax.aot import fingerprint

        out = {"target": res["target"], **fingerprint.toolchain(TARGET),
               "rows": stable(res["rows"]), "summary": res["summary"]}
        report_path().write_text(json.dumps(out, indent=1) + "\n")
        print("->", report_path())


if __name__ == "__main__":
    main()
