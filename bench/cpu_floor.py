"""Where the CPU decode step stands against this machine's floors (demo model, fp32).

    .venv/bin/python bench/cpu_floor.py [--iters 15]

Times, interleaved (A, B, C, ... repeated), the median of:

- `stream_weights`: a jitted sum over an fp32 array as large as the model's weights: the
  memory-bandwidth floor of a batch-1 decode step, which must read every weight once;
- `matvec_chain`: every weight matmul of the model (the layers' fused projections and the LM
  head) at one row, chained, with nothing else: what XLA's GEMVs take;
- `matvec_chain_native`, `matmuls_8_native`: the same chain through the native panel matmul
  (`pallas_kernels/csrc/dense_matmul_cpu.cc`, the unrolled fp32 model's default on CPU) at one
  and eight rows (a speculative verification step's), and `matmuls_8` through XLA;
- `decode_step_1`, `decode_step_8`, `decode_step_64`: the engine's jitted step
  (`ModelRunner.execute`, unrolled layers, native CPU attention, the panel matmul) at 1, 8
  and 64 decoding sequences of 128-token contexts, and `spec_step_5`: one sequence scoring
  its last token and 4 drafts (a speculative verification step, k = 4); each also as
  `..._xla`, the same step on XLA's dots (``PAGEDJAX_DENSE_PANELS=0``);
- `matmuls_64`, `matmuls_64_native`: the same weight matmuls at 64 rows, with the GFLOP/s
  they reach; `matmuls_256_native` and `decode_step_256` the same at 256 rows (the 256 x 64
  workload's decode steps);
- `fma_peak`: the host's fp32 FMA peak on 1 and 2 threads (`bench/fma_peak.cc`, built with
  g++ when one is found; registers only), which no fp32 matmul here can beat;
- `panel_stream`: the native matmul's own inner loop outside XLA at 64 and 256 rows
  (`bench/panel_stream.cc`): one thread on a panel held in L2, one and two threads streaming
  the model's panels from memory: how much of the gap between `matmuls_*_native` and the FMA
  peak is the memory and how much is the engine's calls.

Writes bench/results/cpu/cpu_floor.json with the load average at the start and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fma_peak() -> dict[str, float] | None:
    """fp32 FMA GFLOP/s on 1 and 2 threads from `bench/fma_peak.cc` (None without g++)."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("g++") is None:
        return None
    exe = Path(tempfile.gettempdir()) / "pagedjax_fma_peak"
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", "-pthread",
                    str(ROOT / "bench/fma_peak.cc"), "-o", str(exe)], check=True)
    out = {}
    for t in (1, 2):
        line = subprocess.run([str(exe), str(t), "2"], capture_output=True, text=True,
                              check=True).stdout
        out[f"{t}_threads"] = float(line.split()[2])
    return out


def panel_stream(rows: tuple[int, ...] = (64, 256)) -> dict[str, dict] | None:
    """The native matmul's inner loop outside XLA (`bench/panel_stream.cc`): one thread on a
    panel held in L2, one and two threads streaming the model's panels (None without g++)."""
    import shutil
    import subprocess
    import tempfile

    import jax

    from pallas_kernels.cpu_native import FLAGS

    if shutil.which("g++") is None:
        return None
    exe = Path(tempfile.gettempdir()) / "pagedjax_panel_stream"
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run(["g++", *flags, "-pthread", "-w", f"-I{jax.ffi.include_dir()}",
                    str(ROOT / "bench/panel_stream.cc"), "-o", str(exe)], check=True)
    return {str(m): json.loads(subprocess.run([str(exe), str(m), "5"], capture_output=True,
                                              text=True, check=True).stdout)
            for m in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/cpu_floor.json"))
    args = ap.parse_args()
    load = os.getloadavg()[0]
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.decoder import unstack_layers
    from models.loader import load_model
    from pagedjax.config import EngineConfig
    from pagedjax.core.scheduler import ScheduledSeq
    from pagedjax.spec.config import SpeculativeConfig
    from pagedjax.worker.model_runner import ModelRunner
    from pagedjax.worker.step_inputs import build_step_inputs
    from pallas_kernels.cpu_native import dense_matmul_cpu

    config, params, _ = load_model("smollm2", None)
    # k = 4 speculation only sets the smallest multi-token bucket (5 tokens); decode steps
    # are as without it.
    ec = EngineConfig(num_gpu_blocks=2560, max_model_len=1024, warmup=False,
                      speculative_config=SpeculativeConfig(method="ngram",
                                                           num_speculative_tokens=4))
    runner = ModelRunner(config, params, ec, jnp.float32, 1024)
    os.environ["PAGEDJAX_DENSE_PANELS"] = "0"
    runner_xla = ModelRunner(config, params, ec, jnp.float32, 1024)
    del os.environ["PAGEDJAX_DENSE_PANELS"]
    p = jax.device_put(unstack_layers(params))  # canonical [K, N] kernels, for XLA's dots
    layers = [p[f"layer_{i}"] for i in range(config.num_layers)]
    emb = p["embed"]
    n_weights = sum(x.size for x in jax.tree.leaves(p))
    hidden, inter = config.hidden_size, config.intermediate_size
    panels = [runner.params[f"layer_{i}"] for i in range(config.num_layers)]
    head_panels = runner.params["embed"]["panels"]
    widths = {name: layers[0][name]["kernel"].shape[1]
              for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}

    def native_chain(h, layers, head):
        mm = lambda h, lp, name: dense_matmul_cpu(h, lp[name]["panels"], widths[name])  # noqa: E731
        for lp in layers:
            h = h + mm(h, lp, "qkv_proj")[:, :hidden]
            h = h + mm(h, lp, "o_proj")
            g = mm(h, lp, "gate_up_proj")
            h = h + mm(g[:, :inter], lp, "down_proj")
        return dense_matmul_cpu(h, head, config.vocab_size)

    native_j = jax.jit(native_chain)

    def chain(h, layers, emb):
        for lp in layers:
            h = h + (h @ lp["qkv_proj"]["kernel"])[:, :hidden]
            h = h + h @ lp["o_proj"]["kernel"]
            g = h @ lp["gate_up_proj"]["kernel"]
            h = h + g[:, :inter] @ lp["down_proj"]["kernel"]
        return jnp.einsum("bd,vd->bv", h, emb)

    chain_j = jax.jit(chain)
    flops_64 = 2 * 64 * sum(lp[k]["kernel"].size for lp in layers
                            for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    flops_64 += 2 * 64 * emb.size
    h256 = jnp.full((256, hidden), 1e-3, jnp.float32)
    weights = jax.device_put(np.ones(n_weights, np.float32))
    total = jax.jit(jnp.sum)
    h1 = jnp.full((1, hidden), 1e-3, jnp.float32)
    h8 = jnp.full((8, hidden), 1e-3, jnp.float32)
    h64 = jnp.full((64, hidden), 1e-3, jnp.float32)

    def step_inputs(n, ctx=128, drafts=0):
        per = ctx // 16 + 1
        q = 1 + drafts
        seqs = [ScheduledSeq(i, str(i), [7] * q, ctx - q, list(range(i * per, (i + 1) * per)),
                             True, spec_token_ids=(7,) * drafts) for i in range(n)]
        return build_step_inputs(seqs, 16, runner.max_blocks_per_seq, plan=runner.shape_plan,
                                 spec_lens=[drafts] * n if drafts else None)

    step_256 = step_inputs(256)  # native runner only: the XLA one would hold another cache
    steps = {"decode_step_1": step_inputs(1), "decode_step_8": step_inputs(8),
             "spec_step_5": step_inputs(1, drafts=4), "decode_step_64": step_inputs(64)}
    calls = {
        "stream_weights": lambda: total(weights),
        "matvec_chain": lambda: chain_j(h1, layers, emb),
        **{name: (lambda i=inp: runner.execute(i)) for name, inp in steps.items()},
        **{name + "_xla": (lambda i=inp: runner_xla.execute(i)) for name, inp in steps.items()},
        "matmuls_64": lambda: chain_j(h64, layers, emb),
        "matvec_chain_native": lambda: native_j(h1, panels, head_panels),
        "matmuls_8": lambda: chain_j(h8, layers, emb),
        "matmuls_8_native": lambda: native_j(h8, panels, head_panels),
        "matmuls_64_native": lambda: native_j(h64, panels, head_panels),
        "decode_step_256": lambda: runner.execute(step_256),
        "matmuls_256_native": lambda: native_j(h256, panels, head_panels),
    }
    peak = fma_peak()
    for f in calls.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.iters):
        for k, f in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    gb = 4 * n_weights / 1e9
    res = {"what": "ms per call, median of interleaved calls (bench/cpu_floor.py)",
           "command": "python bench/cpu_floor.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "versions": {"jax": jax.__version__}, "weights_gb_fp32": gb, "ms": ms,
           "stream_gb_per_s": gb / ms["stream_weights"] * 1e3,
           "matmuls_64_gflop_per_s": flops_64 / ms["matmuls_64"] / 1e6,
           "matmuls_64_native_gflop_per_s": flops_64 / ms["matmuls_64_native"] / 1e6,
           "matmuls_256_native_gflop_per_s": 4 * flops_64 / ms["matmuls_256_native"] / 1e6,
           "fma_peak_gflop_per_s": {"before": peak, "after": fma_peak()},
           "panel_stream": panel_stream()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("what",)}, indent=1))


if __name__ == "__main__":
    main()
