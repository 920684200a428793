"""The sampler on XLA:CPU (or a GPU): argmax formulations, the whole `sample` call, the host heap.

    .venv/bin/python bench/sampler.py [--rows 1,64,256] [--reps 3] [--iters 20]
    python3 bench/sampler.py --platform gpu --vocab 128256 --out $OUT/sampler_gpu.json

On a GPU (`--platform gpu`) each rep is one process (the heap setting is a host-memory one) and
the native CPU kernel is left out; the fourth GPU run timed the GPU host's CPU instead, because
this script then always pinned `JAX_PLATFORMS=cpu`.

Each rep runs two fresh processes, one with freed heap memory kept in the process
(`pagedjax/worker/host_heap.py`, the CPU engine's default) and one without
(`PAGEDJAX_KEEP_HEAP=0`), alternating which goes first (A, B, B, A, ...). Each process times,
interleaved, over `[rows, 49152]` fp32 logits (the demo model's vocabulary):

- `jnp_argmax`: `jnp.argmax` (XLA:CPU's variadic reduce) against `first_argmax`
  (`pagedjax/sampler.py`: max, then the first index holding it);
- `log_softmax` (the sampler's raw logprobs);
- `sample_greedy`, `sample_top_p`, `sample_logprobs`: the jitted `sample` as the engine calls
  it (all rows greedy with no top logprobs; all rows temperature 0.8, top-p 0.9; greedy with
  the top-20 logprobs), over standard-normal logits: a flat distribution whose nucleus holds
  thousands of tokens, the top-p worst case (the threshold by bisection);
- `sample_greedy_fast`: `sample_greedy`, what the engine runs for a plain greedy batch (no
  penalties, bans, masks, biases or top logprobs): argmax and logprob per logits row;
- `sample_greedy_native`: the same with ``native=True``, the one-pass kernel the CPU engine
  uses (`pallas_kernels/csrc/greedy_rows_cpu.cc`; omitted where the library does not build);
- `sample_top_p_peaked`: top-p over the same logits times 8, a confident distribution whose
  nucleus lies within the candidates (`TOP_CANDIDATES`), the common case for a trained model
  (`bench/sampler_candidates.py` measures real logits);
- `sample_penalised`: top-p 0.9 at temperature 0.8 over the peaked logits with presence,
  frequency and repetition penalties over 64 prompt and 256 output ids a row;
- `*_native`: those three with ``native=True``, the per-row kernel the CPU engine uses for
  sampled batches (`pallas_kernels/csrc/sample_rows_cpu.cc`); the share of rows whose tokens
  equal the XLA branches' is recorded (`native_same_tokens`).
- `sample_top_k50_peaked`: top-k 50 with top-p 0.9 over the peaked logits (until stop 53 a
  top-k row always took the bisection search).
- On a GPU, `*_chunked`: the sampled calls with ``chunked=True``, the two-stage top-k a GPU
  engine uses (`pagedjax/chunked_top_k.py`; XLA's GPU top-k sorts every row for k > 16), with
  the share of tokens equal to the one-stage call's (`chunked_same_tokens`); and the top-k
  alone: `top_k128` (`lax.top_k(x, 128)`, the one-stage candidates), `top_k16` (the kernel's
  largest k) and `chunked_top_k128_c<chunk>` for chunks of 128 to 2048 logits; and
  `*_chunked_radix<r>`: three of the chunked calls with the exact search by bisection (r 0)
  or at 2 or 4 bits per pass (`sampler.SEARCH_RADIX_BITS`, default 2), tokens compared with
  the one-stage, bisecting call's (`radix_same_tokens`).

Reports the median ms per call for each (heap setting, op, rows) over all reps, with the load
average at the start; on a GPU a call's time is that of 4 back-to-back calls over 4 (device
time; runs up to the seventh GPU run waited after each call, ~0.1-0.2 ms more). Writes
bench/results/cpu/sampler.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152


def radix_sample(r: int):
    """`sample` with chunked candidates and the exact search at ``r`` bits per pass
    (`sampler.SEARCH_RADIX_BITS`, read when a call is traced): a jit of its own."""
    import jax

    import pagedjax.sampler as sampler_mod

    f = jax.jit(lambda x, m, i: sampler_mod.sample.__wrapped__(x, m, num_logprobs=20, rows=i,
                                                               chunked=True))

    def call(x, m, i):
        old, sampler_mod.SEARCH_RADIX_BITS = sampler_mod.SEARCH_RADIX_BITS, r
        try:
            return f(x, m, i)
        finally:
            sampler_mod.SEARCH_RADIX_BITS = old

    return call


def child(rows: list[int], iters: int, vocab: int = VOCAB, gpu_calls: bool | None = None
          ) -> dict:
    """``gpu_calls`` (default: on a GPU) adds the calls a GPU engine makes: the two-stage
    top-k, its search radixes, the top-k alone."""
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.chunked_top_k import chunked_top_k
    from pagedjax.sampler import (
        SamplingMetadata,
        SeqSamplingState,
        first_argmax,
        sample,
        sample_greedy,
    )
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.worker.host_heap import keep_freed_memory
    from pallas_kernels import cpu_native

    kept = keep_freed_memory()
    rng = np.random.default_rng(0)
    on_cpu = jax.default_backend() == "cpu"
    gpu_calls = not on_cpu if gpu_calls is None else gpu_calls
    out: dict = {"heap_kept": kept, "ms": {}, "device": str(jax.devices()[0].device_kind)}
    argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    fast = jax.jit(first_argmax)
    log_softmax = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1))
    top_k128 = jax.jit(lambda x: jax.lax.top_k(x, 128))
    top_k16 = jax.jit(lambda x: jax.lax.top_k(x, 16))
    chunked128 = jax.jit(lambda x, c: chunked_top_k(x, 128, c), static_argnums=1)
    for b in rows:
        logits = jax.device_put(rng.standard_normal((b, vocab)).astype(np.float32))
        peaked = logits * 8
        idx = np.arange(b, dtype=np.int32)

        def meta(p: SamplingParams, want_topk: bool, b=b):
            m = SamplingMetadata.from_params([(p, SeqSamplingState([1], []))] * b, b, vocab)
            return m.replace(want_topk=np.bool_(want_topk))

        greedy = meta(SamplingParams(temperature=0), False)
        top_p = meta(SamplingParams(temperature=0.8, top_p=0.9, seed=1), False)
        with_lp = meta(SamplingParams(temperature=0, logprobs=20), True)
        top_k50 = meta(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1), False)
        # Penalised top-p rows, each with 64 prompt and 256 output ids.
        hist = [SeqSamplingState(rng.integers(0, vocab, 64).tolist(),
                                 rng.integers(0, vocab, 256).tolist()) for _ in range(b)]
        penal = SamplingMetadata.from_params(
            [(SamplingParams(temperature=0.8, top_p=0.9, seed=1, presence_penalty=0.2,
                             frequency_penalty=0.1, repetition_penalty=1.1), h) for h in hist],
            b, vocab).replace(want_topk=np.bool_(False))
        calls = {
            "jnp_argmax": lambda x=logits: argmax(x),
            "first_argmax": lambda x=logits: fast(x),
            "log_softmax": lambda x=logits: log_softmax(x),
            "sample_greedy": lambda x=logits, m=greedy, i=idx: sample(x, m, num_logprobs=20,
                                                                      rows=i),
            "sample_greedy_fast": lambda x=logits, i=idx: sample_greedy(x, i, num_logprobs=20),
            **({"sample_greedy_native": lambda x=logits, i=idx: sample_greedy(
                x, i, num_logprobs=20, native=True)}
               if on_cpu and cpu_native.available() else {}),
            "sample_top_p": lambda x=logits, m=top_p, i=idx: sample(x, m, num_logprobs=20,
                                                                    rows=i),
            "sample_logprobs": lambda x=logits, m=with_lp, i=idx: sample(x, m, num_logprobs=20,
                                                                         rows=i),
            "sample_top_p_peaked": lambda x=peaked, m=top_p, i=idx: sample(x, m, num_logprobs=20,
                                                                           rows=i),
            "sample_penalised": lambda x=peaked, m=penal, i=idx: sample(x, m, num_logprobs=20,
                                                                        rows=i),
            "sample_top_k50_peaked": lambda x=peaked, m=top_k50, i=idx: sample(
                x, m, num_logprobs=20, rows=i),
        }
        sampled = {"sample_top_p": (logits, top_p), "sample_logprobs": (logits, with_lp),
                   "sample_top_p_peaked": (peaked, top_p), "sample_penalised": (peaked, penal),
                   "sample_top_k50_peaked": (peaked, top_k50)}
        if gpu_calls:  # the two-stage top-k a GPU engine samples with, and the top-k alone
            for k, (x, m) in sampled.items():
                calls[f"{k}_chunked"] = lambda x=x, m=m, i=idx: sample(
                    x, m, num_logprobs=20, rows=i, chunked=True)
            # The exact search by bisection (radix0) and 2 and 4 bits per pass (the `_chunked`
            # rows run the default, PAGEDJAX_SEARCH_RADIX_BITS): the flat top-p rows take
            # it; the peaked ones show its cost where it is skipped.
            for r in (0, 2, 4):
                f = radix_sample(r)
                for k in ("sample_top_p", "sample_top_p_peaked", "sample_top_k50_peaked"):
                    x, m = sampled[k]
                    calls[f"{k}_chunked_radix{r}"] = lambda x=x, m=m, i=idx, f=f: f(x, m, i)
            calls["top_k128"] = lambda x=logits: top_k128(x)
            calls["top_k16"] = lambda x=logits: top_k16(x)
            for c in (128, 256, 512, 1024, 2048):
                calls[f"chunked_top_k128_c{c}"] = lambda x=logits, c=c: chunked128(x, c)
        if on_cpu and cpu_native.available():  # the same calls through the per-row kernel
            for k, x, m in (("sample_top_p", logits, top_p), ("sample_top_p_peaked", peaked, top_p),
                            ("sample_penalised", peaked, penal)):
                calls[f"{k}_native"] = lambda x=x, m=m, i=idx: sample(x, m, num_logprobs=20,
                                                                      rows=i, native=True)
        assert (np.asarray(argmax(logits)) == np.asarray(fast(logits))).all()
        if "sample_greedy_native" in calls:
            assert (np.asarray(calls["sample_greedy_native"]().token_ids)
                    == np.asarray(calls["sample_greedy_fast"]().token_ids)).all()
        for k in sampled:
            if f"{k}_native" in calls:  # the same tokens (the kernel's test says where not)
                same = (np.asarray(calls[k]().token_ids)
                        == np.asarray(calls[f"{k}_native"]().token_ids)).mean()
                out.setdefault("native_same_tokens", {})[f"{b}/{k}"] = float(same)
            if f"{k}_chunked" in calls:
                same = (np.asarray(calls[k]().token_ids)
                        == np.asarray(calls[f"{k}_chunked"]().token_ids)).mean()
                out.setdefault("chunked_same_tokens", {})[f"{b}/{k}"] = float(same)
            for r in (0, 2, 4):  # an exact search: the tokens of the one-stage call
                if f"{k}_chunked_radix{r}" in calls:
                    same = (np.asarray(calls[k]().token_ids)
                            == np.asarray(calls[f"{k}_chunked_radix{r}"]().token_ids)).mean()
                    out.setdefault("radix_same_tokens", {})[f"{b}/{k}/{r}"] = float(same)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for f in calls.values():
            jax.block_until_ready(f())
        # On a GPU each timing is 4 calls back to back and one wait (the device's time per
        # call, as in a step where the host runs ahead; a wait per call added ~0.1-0.2 ms of
        # dispatch and wake-up to runs up to the seventh); on a CPU a call and its wait.
        burst = 1 if on_cpu else 4
        for _ in range(iters):
            for k, f in calls.items():
                t0 = time.perf_counter()
                for _ in range(burst):
                    res = f()
                jax.block_until_ready(res)
                times[k].append((time.perf_counter() - t0) / burst)
        out["ms"][str(b)] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    heaps = list(res["median_ms"])
    ops = list(res["median_ms"][heaps[0]][str(rows[0])])
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4))
    for ax, b in zip(axes if len(rows) > 1 else [axes], rows):
        x = range(len(ops))
        for off, heap in ((-0.2, "not_kept"), (0.2, "kept")):
            if heap in heaps:
                ax.bar([i + off for i in x], [res["median_ms"][heap][str(b)][o] for o in ops],
                       width=0.4, label=f"heap {heap.replace('_', ' ')}")
        ax.set_xticks(list(x), ops, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"[{b}, {res['vocab']}] fp32 logits")
        ax.set_ylabel("ms per call (median)")
        ax.legend(fontsize=8)
    where = (res["device"] if res["platform"] == "gpu"
             else f"XLA:CPU, {res['machine']['cpu_count']} cores")
    fig.suptitle(f"sampler on {where} "
                 f"(load {res['machine']['load_avg_1m_at_start']:.2f} at start)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="logits width (128256: Llama 3)")
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu",
                    help="where the sampler runs (gpu: one process per rep, no native kernel)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/sampler.json"))
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.child:
        print(json.dumps(child(rows, args.iters, args.vocab)))
        return
    load = os.getloadavg()[0]
    runs = []
    for rep in range(args.reps):
        order = ("1", "0") if rep % 2 == 0 else ("0", "1")
        if args.platform == "gpu":
            order = ("1",)
        for keep in order:
            env = {**os.environ, "PAGEDJAX_KEEP_HEAP": keep,
                   "JAX_PLATFORMS": "cpu" if args.platform == "cpu" else "cuda"}
            proc = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows,
                                   "--iters", str(args.iters), "--vocab", str(args.vocab)],
                                  env=env, check=True, capture_output=True, text=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            assert r["heap_kept"] == (keep == "1"), r["heap_kept"]
            runs.append({"rep": rep, "heap": "kept" if keep == "1" else "not_kept", **r})
            print(f"rep {rep} heap {runs[-1]['heap']}: {r['ms']}", flush=True)
    med = {heap: {str(b): {op: statistics.median(
        x["ms"][str(b)][op] for x in runs if x["heap"] == heap)
        for op in runs[0]["ms"][str(b)]} for b in rows}
        for heap in ("kept", "not_kept") if any(x["heap"] == heap for x in runs)}
    import jax

    res = {"what": "ms per call, median over reps of per-process medians (bench/sampler.py)",
           "command": "python bench/sampler.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "versions": {"jax": jax.__version__}, "platform": args.platform,
           "device": runs[0]["device"], "vocab": args.vocab, "rows": rows, "median_ms": med,
           "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))
    for b in rows:
        for op in med["kept"][str(b)]:
            print(f"{b:4d} rows {op:20s} " + "   ".join(
                f"heap {h.replace('_', ' ')} {med[h][str(b)][op]:7.2f} ms" for h in med))


if __name__ == "__main__":
    main()
