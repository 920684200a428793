"""The screened LM head against the float32 one, on the demo model's head and real hidden states.

    .venv/bin/python bench/lm_head_greedy.py [--rows 1,8,64,256] [--iters 20]

Records the final hidden states of greedy decode steps (the demo model, fp32, the unrolled
CPU runner: `sample_greedy_hidden`'s input) and times, interleaved, per batch of rows:

- `full`: the float32 LM head (`dense_matmul_cpu` over the head's panels) and the native
  one-pass greedy sampler over its ``[M, V]`` logits (`greedy_rows_cpu`): the path greedy
  rows took before;
- `screened`: `lm_head_greedy_cpu` with the bfloat16 screen: scores with a proven bound and
  the candidates' float32 logits (`pallas_kernels/csrc/lm_head_greedy_cpu.cc`);
- `int8` (AVX512-VNNI hosts): the same with the 8-bit screen.

Tokens must be identical (the run fails otherwise). Also counts, in float64 numpy, how many
columns per row pass each screen (the columns recomputed in float32). Writes
bench/results/cpu/lm_head_greedy.json (with the load average at the start and versions) and
a .png beside it.
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


def record_hidden(n_prompts: int, max_tokens: int):
    """Hidden rows the engine's greedy steps fed to the screened head, and the runner."""
    import numpy as np

    import pagedjax.engine as engine_mod
    from pagedjax import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", max_model_len=1024, cpu_kv_cache_gb=1.0,
              layer_loop="unrolled")
    runner = llm.engine.runner
    if runner.head_screen is None:
        sys.exit("the screened head is not active (native CPU kernels or an unrolled fp32 "
                 "model missing)")
    rows, real = [], engine_mod.sample_greedy_hidden

    def keep(hidden, *a, **k):
        rows.append(np.asarray(hidden))
        return real(hidden, *a, **k)

    engine_mod.sample_greedy_hidden = keep
    texts = ["The history of the printing press", "Why is the sky blue?",
             "Write a short poem about the ocean.", "Explain how a computer stores data."]
    prompts = [f"Question {i}: {texts[i % len(texts)]}" for i in range(n_prompts)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                 use_tqdm=False)
    engine_mod.sample_greedy_hidden = real
    return np.concatenate(rows), runner


def passing_columns(x, screen, vocab: int):
    """Columns per row whose screen interval reaches the row's threshold (float64 numpy)."""
    import ml_dtypes
    import numpy as np

    pairs = screen["bf16"]
    p, kp2 = pairs.shape[:2]
    w = pairs.view(ml_dtypes.bfloat16).astype(np.float32)  # [P, Kp2, 64, 2]
    w = w.transpose(0, 1, 3, 2).reshape(p, kp2 * 2, 64)[:, : x.shape[1]]
    w = w.transpose(1, 0, 2).reshape(x.shape[1], -1)[:, :vocab].astype(np.float64)
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    s = xb @ w
    k = x.shape[1]
    ub, u = 2.0 ** -9, 2.0 ** -24
    gk = k * u / (1 - k * u)
    c = 1.01 * ((2 * ub + ub * ub) + gk * (1 + ub) ** 2 + gk)
    b = c * np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * screen["norms"][None] + 1e-12
    t = (s - b).max(axis=1, keepdims=True)
    return (s + b >= t).sum(axis=1)


def passing_columns_int8(x, screen, panels, vocab: int):
    """Columns per row whose 8-bit screen interval reaches the row's threshold (float64 numpy,
    the kernel's rule: per 6-row block the 24 dimensions with the largest |x_k| / ||x|| in
    float32, the rest in steps)."""
    import numpy as np

    codes = screen["int8"]
    p, kq = codes.shape[:2]
    k = x.shape[1]
    q = codes.transpose(0, 1, 3, 2).reshape(p, 4 * kq, 64)[:, :k]
    q = q.transpose(1, 0, 2).reshape(k, -1)[:, :vocab].astype(np.float64)
    step, err = (screen["qcols"][i, :vocab].astype(np.float64) for i in range(2))
    w = np.asarray(panels).transpose(1, 0, 2).reshape(k, -1)[:, :vocab].astype(np.float64)
    u = 2.0 ** -24
    gk = k * u / (1 - k * u)
    out, blocks = [], []
    for b0 in range(0, len(x), 6):
        xb = x[b0:b0 + 6].astype(np.float64)
        nrm = np.linalg.norm(xb, axis=1, keepdims=True)
        score = (np.abs(xb) / np.where(nrm > 0, nrm, 1)).max(axis=0)
        blocks += [np.sort(np.argsort(-score, kind="stable")[:24])] * len(xb)
    for xr, o in zip(x.astype(np.float64), blocks):
        rest = np.setdiff1d(np.arange(k), o)
        t = float(np.float32(np.abs(xr[rest]).max()) / np.float32(127))
        xt = np.zeros(k)
        xt[rest] = np.clip(np.rint(xr[rest] / t), -127, 127) * t
        s = (xt @ q) * step + xr[o] @ w[o]
        ex = np.linalg.norm(xr[rest] - xt[rest])
        b = (1.02 * (ex + (gk + 1024 * u) * np.linalg.norm(xr)) * screen["norms"]
             + 1.02 * np.linalg.norm(xt) * err + 1e-12)
        out.append(int(np.sum(s + b >= np.max(s - b))))
    return np.asarray(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/lm_head_greedy.json"))
    args = ap.parse_args()
    load0 = os.getloadavg()[0]

    import jax
    import jaxlib
    import numpy as np

    from pallas_kernels import cpu_native

    sizes = [int(r) for r in args.rows.split(",")]
    hidden, runner = record_hidden(max(sizes), 24)
    vocab = runner.model_config.vocab_size
    panels = runner.head_panels
    host_panels = np.asarray(panels)
    kinds = ["bf16"] + (["int8"] if "avx512vnni" in cpu_native.compiled_isa() else [])
    screens = {kind: jax.device_put(cpu_native.lm_head_screen(host_panels, vocab, kind))
               for kind in kinds}
    full = jax.jit(lambda x, p: cpu_native.greedy_rows_cpu(
        cpu_native.dense_matmul_cpu(x, p, vocab))[0])
    fast = jax.jit(lambda x, s, p: cpu_native.lm_head_greedy_cpu(x, s, p))
    names = {"bf16": "screened", "int8": "int8"}
    rng = np.random.default_rng(0)
    out = {"what": "ms per call, median of interleaved calls (bench/lm_head_greedy.py)",
           "command": "python " + " ".join(["bench/lm_head_greedy.py", *sys.argv[1:]]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load0,
                       "isa": sorted(cpu_native.compiled_isa())},
           "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                        "python": platform.python_version()},
           "hidden_rows_recorded": int(len(hidden)), "rows": {}}
    host = {kind: {k: np.asarray(v) for k, v in sc.items()} for kind, sc in screens.items()}
    for m in sizes:
        x = jax.device_put(hidden[rng.choice(len(hidden), m, replace=len(hidden) < m)],
                           jax.devices("cpu")[0])
        a = np.asarray(full(x, panels))
        for kind in kinds:
            if not (a == np.asarray(fast(x, screens[kind], panels))).all():
                sys.exit(f"rows {m}: tokens differ between the full and the {kind} screened head")
        calls = [("full", full, (x, panels))] + [
            (names[kind], fast, (x, screens[kind], panels)) for kind in kinds]
        ts = {name: [] for name, _, _ in calls}
        for _ in range(args.iters):
            for name, f, fargs in calls:
                t0 = time.perf_counter()
                jax.block_until_ready(f(*fargs))
                ts[name].append(1e3 * (time.perf_counter() - t0))
        row = {k: statistics.median(v) for k, v in ts.items()}
        row["speedup"] = row["full"] / row["screened"]
        cand = passing_columns(np.asarray(x), host["bf16"], vocab)
        row["candidates_per_row"] = {"mean": float(cand.mean()), "max": int(cand.max())}
        line = (f"rows {m}: full {row['full']:.2f} ms, bf16 screen {row['screened']:.2f} ms "
                f"({row['speedup']:.2f}x, recomputed per row: mean {cand.mean():.1f}, max "
                f"{cand.max()})")
        if "int8" in kinds:
            c8 = passing_columns_int8(np.asarray(x), host["int8"], host_panels, vocab)
            row["int8_speedup"] = row["full"] / row["int8"]
            row["int8_candidates_per_row"] = {"mean": float(c8.mean()), "max": int(c8.max())}
            line += (f", 8-bit screen {row['int8']:.2f} ms ({row['int8_speedup']:.2f}x, "
                     f"recomputed per row: mean {c8.mean():.1f}, max {c8.max()})")
        out["rows"][str(m)] = row
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Both paths' ms per call against the rows of the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(res["rows"], key=int)
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    series = [("full", "float32 head + greedy sampler"),
              ("screened", "bfloat16 screen + float32 candidates"),
              ("int8", "8-bit screen + float32 candidates")]
    series = [(n, label) for n, label in series if n in res["rows"][rows[0]]]
    width = 0.8 / len(series)
    for i, (name, label) in enumerate(series):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in x],
               [res["rows"][r][name] for r in rows], width, label=label)
    ax.set_xticks(list(x), [f"{r} row" + ("s" if r != "1" else "") for r in rows])
    ax.set_ylabel("ms per call (median)")
    ax.set_yscale("log")
    ax.set_title("Greedy tokens from the demo model's LM head (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
