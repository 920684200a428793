"""Tensor-parallel benchmark: step time, tokens/s, correctness and collectives per layer.

For each TP size (default 1/2/4/8) on a synthetic Llama (8 query / 2 KV heads, so TP=4/8
replicate KV heads) this measures:

* decode step time (batch 8, 64-token contexts) and prefill step time (256 tokens), median
  of jitted `ModelRunner.execute` calls;
* end-to-end greedy generation tokens/s through `LLM.generate`, and whether the tokens equal
  TP=1's, plus the max |logits - logits_TP1| of the prefill step;
* collectives in the compiled step's HLO, split into the scanned layer body (per layer) and
  the rest (embedding lookup, logits gather), for the embedding split on the vocabulary vs
  replicated (the choice documented in docs/tensor-parallel.md);
* per-device parameter bytes, from the arrays' shardings.

On CPU the N "devices" are forced host devices sharing the same cores
(`--xla_force_host_platform_device_count`), so CPU numbers show the overhead of the
partitioned program and its collectives, not a speedup. Writes JSON + PNG under
``bench/results/<device>/tensor_parallel.*``.
"""

from __future__ import annotations

import os
import sys

if "--no-force-devices" not in sys.argv and "xla_force_host_platform_device_count" not in \
        os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from results_dir import RESULTS, device_tag  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.config import EngineConfig  # noqa: E402
from pagedjax.core.scheduler import ScheduledSeq  # noqa: E402
from pagedjax.parallel.hlo import count_collectives  # noqa: E402
from pagedjax.parallel.mesh import sharded_param_bytes  # noqa: E402
from pagedjax.worker.model_runner import ModelRunner  # noqa: E402
from pagedjax.worker.step_inputs import StepInputs, build_step_inputs  # noqa: E402


def bench_config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                       num_layers=layers, num_heads=8, num_kv_heads=2, head_dim=64,
                       max_position_embeddings=1024, eos_token_ids=(2,))


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    from models.weights import assemble_params, expected_shapes

    rng = np.random.default_rng(seed)
    shapes = expected_shapes(config)
    tensors = {n: (1.0 + 0.1 * rng.standard_normal(s) if "norm" in n
                   else 0.05 * rng.standard_normal(s)).astype(np.float32)
               for n, s in shapes.items()}
    return assemble_params(config, tensors.get)


class NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def time_step(runner: ModelRunner, inputs: StepInputs, iters: int) -> float:
    jax.block_until_ready(runner.execute(inputs))  # compile
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.execute(inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_inputs(runner: ModelRunner, batch: int, q_len: int, ctx: int) -> StepInputs:
    """`batch` sequences of `ctx` context, `q_len` new tokens each, on disjoint blocks."""
    bs = runner.block_size
    per_seq = -(-ctx // bs)
    rng = np.random.default_rng(1)
    seqs = [ScheduledSeq(i, str(i), [int(t) for t in rng.integers(3, 1000, q_len)], ctx - q_len,
                         list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(batch)]
    return build_step_inputs(seqs, bs, runner.max_blocks_per_seq)


def hlo_of(runner: ModelRunner, inputs: StepInputs) -> str:
    lowered = runner._step.lower(runner, runner.params, runner.k_cache, runner.v_cache,
                                 inputs.input_ids, inputs.positions,
                                 runner.step_meta(inputs.meta),
                                 inputs.logits_indices)
    return lowered.compile().as_text()


def measure(config, params, tp: int, shard_vocab: bool, args, ref_logits=None) -> dict:
    ec = EngineConfig(block_size=16, num_gpu_blocks=64, tensor_parallel_size=tp)
    runner = ModelRunner(config, params, ec, jnp.float32, 1024, shard_vocab=shard_vocab)
    decode = step_inputs(runner, 8, 1, 64)
    prefill = step_inputs(runner, 1, 256, 256)
    row = {
        "tp": tp, "shard_vocab": shard_vocab,
        "decode_step_ms": 1e3 * time_step(runner, decode, args.iters),
        "prefill_step_ms": 1e3 * time_step(runner, prefill, args.iters),
        "collectives_decode": count_collectives(hlo_of(runner, decode)),
    }
    total, per_device = sharded_param_bytes(runner.params)
    row["param_bytes_total"], row["param_bytes_per_device"] = total, per_device
    logits = np.asarray(runner.execute(prefill))
    row["max_abs_logits_diff_vs_tp1"] = (0.0 if ref_logits is None
                                         else float(np.abs(logits - ref_logits).max()))
    return row, logits


def generate(config, params, tp: int, args) -> tuple[float, list[list[int]]]:
    llm = LLM.from_params(config, params, NoTokenizer(), tensor_parallel_size=tp, block_size=16,
                          num_gpu_blocks=128, max_num_seqs=8)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 1000, 32)]}
               for _ in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, sp)  # compile every bucket
    llm.reset_prefix_cache()  # the timed run computes its prompts again
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return args.batch * args.max_tokens / dt, [o.outputs[0].token_ids for o in outs]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in rows if r["shard_vocab"]]
    tps = [r["tp"] for r in main]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(tps, [r["decode_step_ms"] for r in main], "o-", label="decode (8 seqs)")
    axes[0].plot(tps, [r["prefill_step_ms"] for r in main], "s-", label="prefill (256 tok)")
    axes[0].set(xlabel="TP size", ylabel="step time (ms)", xscale="log", xticks=tps)
    axes[0].set_xticklabels(tps)
    axes[0].legend()
    axes[1].plot(tps, [r["tokens_per_s"] for r in main], "o-")
    axes[1].set(xlabel="TP size", ylabel="generate tokens/s", xscale="log", xticks=tps)
    axes[1].set_xticklabels(tps)
    for vocab in (True, False):
        rs = [r for r in rows if r["shard_vocab"] == vocab]
        axes[2].plot([r["tp"] for r in rs], [r["param_bytes_per_device"] / 2**20 for r in rs],
                     "o-", label="embed/lm_head split on vocab" if vocab else "replicated")
    axes[2].set(xlabel="TP size", ylabel="param MiB per device", xscale="log", xticks=tps)
    axes[2].set_xticklabels(tps)
    axes[2].legend()
    for ax in axes:
        ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def title(meta: dict, tag: str) -> str:
    shared = f" (forced host devices sharing {meta['cpu_count']} cores)" if tag == "cpu" else ""
    return f"pagedjax TP on {meta['device']} x{meta['num_devices']}{shared}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the PNG from the saved JSON")
    ap.add_argument("--no-force-devices", action="store_true",
                    help="use the real devices (GPUs) instead of forced host devices")
    args = ap.parse_args()
    tag = device_tag()
    out_dir = RESULTS / tag
    if args.plot_only:
        saved = json.loads((out_dir / "tensor_parallel.json").read_text())
        plot(saved["rows"], out_dir / "tensor_parallel.png", title(saved["meta"], tag))
        return

    config = bench_config(args.layers)
    params = random_params(config)
    rows, ref_logits, ref_tokens = [], None, None
    for tp in args.tp:
        for shard_vocab in ((True, False) if tp > 1 else (True,)):
            row, logits = measure(config, params, tp, shard_vocab, args, ref_logits)
            if tp == 1:
                ref_logits = logits
            if shard_vocab:
                tps, tokens = generate(config, params, tp, args)
                ref_tokens = tokens if tp == 1 else ref_tokens
                row["tokens_per_s"] = tps
                row["tokens_match_tp1"] = tokens == ref_tokens
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
            "forced_host_devices": "xla_force_host_platform_device_count" in
            os.environ.get("XLA_FLAGS", ""), "cpu_count": os.cpu_count(),
            "model": {k: getattr(config, k) for k in ("vocab_size", "hidden_size",
                                                      "intermediate_size", "num_layers",
                                                      "num_heads", "num_kv_heads", "head_dim")},
            "jax": jax.__version__, "args": vars(args)}
    (out_dir / "tensor_parallel.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                             indent=1))
    plot(rows, out_dir / "tensor_parallel.png", title(meta, tag))
    print(f"wrote {out_dir / 'tensor_parallel.json'}")


if __name__ == "__main__":
    main()
