"""Expert placement under tensor parallelism: experts split by width vs whole experts per
device (`EngineConfig.enable_expert_parallel`), on two MoE shapes.

    .venv/bin/python bench/moe_parallel.py [--tp 2] [--reps 5] [--iters 10]

Models (synthetic weights, fp32, 4 layers, hidden 512, 8 query / 2 KV heads, vocab 32000):
"wide" — Mixtral-like, 8 experts of 1408, top-2; "narrow" — Qwen3-MoE-like, 32 experts of
256, top-4 (at TP 2 the width split leaves 128-wide slices). For each, and for each split:
the step time of a decode at batch 1 / 16 / 64 (64-token contexts) and of a 256-token
prefill (median of ``--iters`` calls of the jitted step, the two splits alternated A, B, A, B
for ``--reps`` rounds), the collectives XLA put in the layer body, per-device parameter
bytes, and max |logits - logits at TP 1| of the prefill.

On CPU the N "devices" are forced host devices sharing the machine's cores
(`--xla_force_host_platform_device_count`), so the figures compare the two partitioned
programs on the same hardware, not a multi-GPU speedup. Refuses to run on a busy machine
(1-minute load average above ``--max-load``). Writes JSON + PNG under
``bench/results/<device>/moe_parallel.*``.
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from results_dir import RESULTS, device_tag  # noqa: E402
from tensor_parallel import hlo_of, random_params, step_inputs, time_step  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from pagedjax.config import EngineConfig  # noqa: E402
from pagedjax.parallel.hlo import count_collectives  # noqa: E402
from pagedjax.parallel.mesh import sharded_param_bytes  # noqa: E402
from pagedjax.worker.model_runner import ModelRunner  # noqa: E402

SHAPES = {"decode_b1": (1, 1, 64), "decode_b16": (16, 1, 64), "decode_b64": (64, 1, 64),
          "prefill_256": (1, 256, 256)}


def moe_config(kind: str) -> ModelConfig:
    experts, width, top_k = {"wide": (8, 1408, 2), "narrow": (32, 256, 4)}[kind]
    return ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=width, num_layers=4,
                       num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=1024,
                       eos_token_ids=(2,), architecture="mixtral", num_experts=experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=width,
                       norm_topk_prob=True)


def runner_for(config, params, tp: int, ep: bool) -> ModelRunner:
    ec = EngineConfig(block_size=16, num_gpu_blocks=320, tensor_parallel_size=tp,
                      enable_expert_parallel=ep, layer_loop="scan")
    return ModelRunner(config, params, ec, jnp.float32, 1024)


def measure(kind: str, tp: int, reps: int, iters: int) -> dict:
    config = moe_config(kind)
    params = random_params(config)
    ref = runner_for(config, params, 1, False)
    ref_logits = np.asarray(ref.execute(step_inputs(ref, *SHAPES["prefill_256"])))
    del ref
    runners = {"width": runner_for(config, params, tp, False),
               "experts": runner_for(config, params, tp, True)}
    inputs = {split: {name: step_inputs(r, *shape) for name, shape in SHAPES.items()}
              for split, r in runners.items()}
    times = {split: {name: [] for name in SHAPES} for split in runners}
    for _ in range(reps):
        for name in SHAPES:
            for split, r in runners.items():  # A, B alternated within each round
                times[split][name].append(1e3 * time_step(r, inputs[split][name], iters))
    out = {}
    for split, r in runners.items():
        total, per_device = sharded_param_bytes(r.params)
        logits = np.asarray(r.execute(inputs[split]["prefill_256"]))
        out[split] = {
            "step_ms_median": {n: round(statistics.median(v), 3) for n, v in times[split].items()},
            "step_ms_runs": {n: [round(x, 3) for x in v] for n, v in times[split].items()},
            "collectives": count_collectives(hlo_of(r, inputs[split]["decode_b16"])),
            "param_bytes_total": total, "param_bytes_per_device": per_device,
            "max_abs_logits_diff_vs_tp1": float(np.abs(logits - ref_logits).max()),
        }
    return {"config": {"experts": config.num_experts, "expert_width": config.moe_intermediate_size,
                       "top_k": config.num_experts_per_tok, "layers": config.num_layers,
                       "hidden": config.hidden_size}, "tp": tp, "splits": out}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(res["models"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4))
    for ax, kind in zip(np.atleast_1d(axes), kinds, strict=True):
        m = res["models"][kind]
        x = np.arange(len(SHAPES))
        for i, split in enumerate(("width", "experts")):
            ax.bar(x + (i - 0.5) * 0.4, [m["splits"][split]["step_ms_median"][n] for n in SHAPES],
                   0.4, label=f"experts split by {split}")
        c = m["config"]
        ax.set_title(f"{kind}: {c['experts']} experts x {c['expert_width']}, top-{c['top_k']}, "
                     f"TP {m['tp']}")
        ax.set_xticks(x, list(SHAPES))
        ax.set_ylabel("step ms (median)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-load", type=float, default=0.5)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > args.max_load:
        raise SystemExit(f"1-minute load average {load:.2f} > {args.max_load}: a busy machine "
                         "gives no result (--max-load to override)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res = {"what": "bench/moe_parallel.py (see its docstring)",
           "command": "python bench/moe_parallel.py " + " ".join(sys.argv[1:]),
           "commit": commit,
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load,
                       "devices": f"{jax.device_count()} forced host devices"},
           "versions": {"jax": jax.__version__, "python": platform.python_version()},
           "models": {}}
    for kind in ("wide", "narrow"):
        res["models"][kind] = m = measure(kind, args.tp, args.reps, args.iters)
        for split, r in m["splits"].items():
            print(kind, split, r["step_ms_median"], r["collectives"]["per_layer"],
                  f"diff {r['max_abs_logits_diff_vs_tp1']:.2e}", flush=True)
    res["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    out = RESULTS / device_tag() / "moe_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
