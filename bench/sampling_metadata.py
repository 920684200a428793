"""A sampled step's metadata and sampler call, with the fixed-width id arrays on the host
(numpy, as before stop 76) against device arrays (`pagedjax.sampler.DeviceFill`).

    .venv/bin/python bench/sampling_metadata.py [--rows 256] [--iters 200] [--reps 3]

With any row penalised, banned, masked or biased, `SamplingMetadata.assemble` makes the ban
lists, token masks and logit biases at fixed widths (so one compiled sampler serves every
such batch): at 256 rows of the demo model's vocabulary ~4.5 MB a step, nearly always empty.
The rows are `bench/host_overhead.py`'s `mixed` mix: every other row samples at temperature
0.8, top-p 0.9, with presence and repetition penalties and 2 top logprobs; the others are
greedy. Each iteration builds the step's metadata from the rows kept across steps
(`SamplingBatch.metadata`, penalty histories left to the device as the engine does; here
constant device arrays, the same for both) and runs the jitted `sample` as the engine calls
it (the native CPU sampler where it builds) on fixed random logits, to the tokens.

`host` and `device` run interleaved (A, B, B, A, ...), each iteration timed; both must
sample the same tokens. Reports per variant the median and p99 of the metadata build and of
the whole (build + sampler call + wait), with the load average at the start; writes
bench/results/cpu/sampling_metadata.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from pagedjax.sampler import DeviceFill, SeqSamplingState, sample  # noqa: E402
from pagedjax.sampling_params import (  # noqa: E402
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagedjax.worker.sampling_batch import SamplingBatch  # noqa: E402

VOCAB = 49152  # the demo model's
HISTORY = 2048  # max_model_len: the device histories' width


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def mixed_rows(n: int) -> list[tuple[SamplingParams, SeqSamplingState]]:
    rows = []
    for i in range(n):
        if i % 2:
            sp = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.2,
                                repetition_penalty=1.1, logprobs=2, max_tokens=1000,
                                ignore_eos=True, seed=i)
        else:
            sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        rows.append((sp, SeqSamplingState(list(range(128)), list(range(40 + i % 7)), i, 0, 0)))
    return rows


class Variant:
    """One way of building the metadata, with its own `SamplingBatch` (the slots are written
    on the first call, as a row's first step)."""

    def __init__(self, n: int, fill: DeviceFill | None, histories: tuple) -> None:
        self.rows = mixed_rows(n)
        self.keys = [(i, 0) for i in range(n)]
        self.batch = SamplingBatch(VOCAB, 4 * n, eos_token_ids=[2])
        self.fill, self.histories = fill, histories
        self.widths = dict(history_width=HISTORY,
                           ban_width=_pow2(MAX_STOP_TOKEN_IDS + 1 + 2 * MAX_BAD_WORDS),
                           mask_width=-(-VOCAB // 32), bias_width=_pow2(MAX_LOGIT_BIAS))

    def metadata(self):
        meta = self.batch.metadata(self.rows, self.keys, len(self.rows), pack_histories=False,
                                   fill=self.fill, **self.widths)
        out, prompt = self.histories
        return meta.replace(output_token_ids=out, prompt_token_ids=prompt,
                            want_topk=np.bool_(True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/sampling_metadata.json"))
    args = ap.parse_args()
    load = os.getloadavg()[0]
    from pallas_kernels import cpu_native

    native = jax.default_backend() == "cpu" and cpu_native.available()
    n = args.rows
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    logits = jax.device_put((rng.standard_normal((n, VOCAB)) * 8).astype(np.float32), dev)
    src = jax.device_put(np.arange(n, dtype=np.int32), dev)
    # Penalty histories as the engine's device gather leaves them: committed [n, HISTORY].
    hist = np.full((n, HISTORY), -1, np.int32)
    for i, (_, s) in enumerate(mixed_rows(n)):
        hist[i, : len(s.output_token_ids)] = s.output_token_ids
    prompt = np.full((n, HISTORY), -1, np.int32)
    prompt[:, :128] = np.arange(128)
    histories = (jax.device_put(hist, dev), jax.device_put(prompt, dev))
    variants = {"host": Variant(n, None, histories), "device": Variant(n, DeviceFill(),
                                                                        histories)}

    def once(v: Variant) -> tuple[float, float, np.ndarray]:
        t0 = time.perf_counter()
        meta = v.metadata()
        t1 = time.perf_counter()
        out = sample(logits, meta, num_logprobs=MAX_LOGPROBS, rows=src, native=native)
        tokens = np.asarray(out.token_ids)
        return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3, tokens

    tokens = {k: once(v)[2] for k, v in variants.items()}  # compile both
    same = bool(np.array_equal(tokens["host"], tokens["device"]))
    times: dict[str, dict[str, list[float]]] = {k: {"build": [], "total": []} for k in variants}
    for rep in range(args.reps):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            for _ in range(args.iters):
                b, t, tok = once(variants[name])
                times[name]["build"].append(b)
                times[name]["total"].append(t)
                same = same and bool(np.array_equal(tok, tokens["host"]))
    summary = {name: {f"{k}_{stat}_ms": float(f(np.asarray(v)))
                      for k, v in t.items()
                      for stat, f in (("median", np.median),
                                      ("p99", lambda a: np.percentile(a, 99)))}
               for name, t in times.items()}
    res = {"what": "ms per sampled step: SamplingBatch.metadata, and it plus the jitted sample "
                   "call to the tokens, the fixed-width id arrays on the host (numpy) or the "
                   "device (DeviceFill) (bench/sampling_metadata.py)",
           "command": "python bench/sampling_metadata.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load,
                       "backend": jax.default_backend(), "device": str(dev)},
           "versions": {"python": platform.python_version(), "jax": jax.__version__,
                        "numpy": np.__version__},
           "rows": n, "iters": args.iters, "reps": args.reps, "native_sampler": native,
           "same_tokens": same, "variants": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:6s} build median {s['build_median_ms']:.3f} ms (p99 "
              f"{s['build_p99_ms']:.3f}), build + sample median {s['total_median_ms']:.3f} ms "
              f"(p99 {s['total_p99_ms']:.3f})")
    print(f"same tokens: {same}; load at start {load:.2f}")
    if not same:
        sys.exit("the two variants sampled different tokens")


if __name__ == "__main__":
    main()
