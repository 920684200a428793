"""Benchmark the paged-attention kernels.

Decode: our paged kernel vs the same kernel on a contiguous cache (identity block table,
so only the paging indirection differs) vs jax's upstream Pallas paged_attention vs the
XLA reference, over batch x context x block size (bf16, head_dim 128, 8 KV / 32 Q heads).
Each point reports the median time, bytes of K/V read, achieved GB/s and that as a % of a
device-to-device copy measured in the same run. Ragged: one mixed launch (a prefill chunk
plus decode rows) vs running the prefill and the decode batch separately.

``--quick`` (and any CPU run) is a smoke sweep on tiny shapes with the XLA backend only:
it checks the harness end to end and makes no performance claim. Outputs JSON + PNG under
``bench/results/<device>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_decode_attention, ragged_paged_attention

if __package__:  # imported as bench.kernels (the GPU suite, bench/gpu_suite)
    from bench.results_dir import RESULTS, device_tag
else:  # run as `python bench/kernels.py` (bench/ is on sys.path)
    from results_dir import RESULTS, device_tag


def bench(fn: Callable[[], jax.Array], iters: int, warmup: int = 2,
          pipelined: bool = True) -> float:
    """Seconds per call of ``fn()`` (which must dispatch a jitted call).

    ``pipelined`` (default): rounds of ``max(4, iters // 4)`` calls dispatched back to back
    with one wait, on the last result, at the end of each (the device runs them in order),
    and the fastest round's time per call (the minimum, as noise only adds): the larger of
    the device's time per call and the host's time to dispatch one, so a kernel's cost as it
    runs inside a step, with nothing waiting between launches, wherever the device is the
    slower of the two (a tiny kernel may instead show the dispatch). Timing
    each call with its own wait adds a host dispatch and a wake-up: on the seventh H200 run
    (2026-11-30) a decode kernel at batch 1 read "0.09 ms" that way, the whole 8B step at
    batch 32 x 4096 left at most ~0.28 ms a layer for a kernel timed at 0.51 ms alone, and a
    2 GiB read timed 2.6-3.1 TB/s while the weight-only matmul chain read 3.4 TB/s.
    ``pipelined=False``: the median of per-call times with a wait after each, what a
    synchronous caller sees (the e2e stage's whole-step times, comparable across runs).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    if not pipelined:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    per_round = max(4, iters // 4)
    best = math.inf
    for _ in range(max(2, iters // per_round)):
        t0 = time.perf_counter()
        for _ in range(per_round):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / per_round)
    return best


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device-to-device copy GB/s (read + write) for an array of ``nbytes``."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = bench(lambda: f(x), iters)
    return 2 * nbytes / t / 1e9


def read_bandwidth(nbytes: int, iters: int) -> float:
    """Device read GB/s: the faster of two reductions of an array of ``nbytes`` that read it
    once and write almost nothing (a max over all of it, and row maxima over rows of 4096).
    A decode step's traffic is reads (weights, KV), so this, not the copy's read + write
    rate, is its roofline: on the sixth H200 run the whole 8B step at batch 1 read 2.6 TB/s,
    above the 2.0 TB/s that the copy measured."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    width = 4096 if x.size % 4096 == 0 else x.size
    whole = jax.jit(jnp.max)
    per_row = jax.jit(lambda a: jnp.max(a.reshape(-1, width), axis=1))  # a view in the jit
    t = min(bench(lambda: whole(x), iters), bench(lambda: per_row(x), iters))
    return nbytes / t / 1e9


def make_decode_inputs(batch, ctx, bs, hkv, hq, d, dtype, contiguous, seed=0):
    rng = np.random.default_rng(seed)
    pages = ctx // bs
    num_blocks = batch * pages
    ids = np.arange(num_blocks) if contiguous else rng.permutation(num_blocks)
    tables = jnp.asarray(ids.reshape(batch, pages), jnp.int32)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (1, hkv, num_blocks, bs, d)
    k = jax.random.normal(k1, shape, dtype)
    v = jax.random.normal(k2, shape, dtype)
    q = jax.random.normal(k3, (batch, hq, d), dtype)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return q, k, v, tables, lens


def decode_fn(variant: str, bs: int, ctx: int, scale: float, backend: str | None) -> Callable:
    """The jitted decode call of one variant: (q, k, v, tables, lens) -> out."""
    if variant in ("paged", "contiguous"):
        return jax.jit(lambda q, k, v, bt, lens: paged_decode_attention(
            q, k, v, bt, lens, scale=scale, layer=0, backend=backend))
    if variant == "mosaic":  # the Mosaic GPU decode kernel (Hopper only), compiled
        from pallas_kernels.mosaic_decode_attention import mosaic_paged_decode

        return jax.jit(lambda q, k, v, bt, lens: mosaic_paged_decode(
            q, k, v, bt, lens, jnp.int32(0), scale=scale))
    if variant == "xla_ref":
        return jax.jit(lambda q, k, v, bt, lens: paged_decode_attention(
            q, k, v, bt, lens, scale=scale, layer=0, backend="xla"))
    if variant != "upstream":
        raise ValueError(f"unknown variant {variant!r}")
    # jax upstream Pallas paged_attention (4-D [Hkv, NB, bs, D] pages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as upstream
    pages = ctx // bs
    ppcb = max(1, min(pages, 64 // bs))
    splits = max(1, min(16, pages // ppcb))
    while pages % splits or (pages // splits) % ppcb:
        splits -= 1
    return jax.jit(lambda q, k, v, bt, lens: upstream.paged_attention(
        q * scale, k[0], v[0], bt, lens, pages_per_compute_block=ppcb, k_splits=splits))


def decode_point(args, variant: str, batch: int, ctx: int, bs: int, hkv: int, hq: int, d: int,
                 dtype, copy_gbps: float) -> dict:
    """Time one (variant, batch, context, block size) point; errors are recorded, not raised."""
    kv_bytes = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
    row = dict(kernel="decode", variant=variant, batch=batch, context=ctx, block_size=bs,
               bytes=kv_bytes)
    try:
        q, k, v, bt, lens = make_decode_inputs(batch, ctx, bs, hkv, hq, d, dtype,
                                               variant == "contiguous")
        f = decode_fn(variant, bs, ctx, d**-0.5, args.backend)
        t = bench(lambda: f(q, k, v, bt, lens), args.iters)
        gbps = kv_bytes / t / 1e9
        row.update(time_ms=t * 1e3, gbps=gbps, pct_of_copy=100 * gbps / copy_gbps)
    except Exception as e:  # record and move on: one failing variant must not stop
        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
    return row


def run_decode(args, variants, grid, hkv, hq, d, dtype, copy_gbps,
               on_row: Callable[[dict], None] | None = None):
    rows = []
    for batch, ctx, bs in grid:
        for variant in variants:
            row = decode_point(args, variant, batch, ctx, bs, hkv, hq, d, dtype, copy_gbps)
            print(json.dumps(row))
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def make_ragged_inputs(hkv, hq, d, dtype, seqs: list[tuple[int, int]], bs: int, seed: int = 1):
    """Ragged batch of ``(query_len, kv_len)`` sequences on permuted blocks:
    (q, k, v, kv_lens, block_tables, cu_q_lens) as device arrays."""
    rng = np.random.default_rng(seed)
    pages = [-(-kv // bs) for _, kv in seqs]
    max_pages = max(pages)
    num_blocks = sum(pages)
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), max_pages), np.int32)
    off = 0
    for s, n in enumerate(pages):
        tables[s, :n] = perm[off : off + n]
        off += n
    key = jax.random.key(seed + 1)
    shape = (1, hkv, num_blocks, bs, d)
    k = jax.random.normal(key, shape, dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    q_lens = np.array([ql for ql, _ in seqs])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (int(cu[-1]), hq, d), dtype)
    return q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu)


def run_ragged(args, hkv, hq, d, dtype, prefill_len, prefill_ctx, num_decode, decode_ctx, bs):
    """One mixed ragged launch vs prefill-only ragged launch + a decode launch."""
    seqs = [(prefill_len, prefill_ctx)] + [(1, decode_ctx)] * num_decode
    q, k, v, kv_lens, bt, cu = make_ragged_inputs(hkv, hq, d, dtype, seqs, bs)
    scale = d**-0.5
    be = args.backend
    ragged = jax.jit(lambda q, k, v, kl, bt, cu, n: ragged_paged_attention(
        q, k, v, kl, bt, cu, n, scale=scale, layer=0, backend=be))
    decode = jax.jit(lambda q, k, v, bt, lens: paged_decode_attention(
        q, k, v, bt, lens, scale=scale, layer=0, backend=be))
    mixed = lambda: ragged(q, k, v, kv_lens, bt, cu, jnp.int32(len(seqs)))
    pre_q = q[:prefill_len]
    pre = lambda: ragged(pre_q, k, v, kv_lens[:1], bt[:1], cu[:2], jnp.int32(1))
    dec_q = q[prefill_len:]
    dec = lambda: decode(dec_q, k, v, bt[1:], kv_lens[1:])
    t_mixed = bench(mixed, args.iters)
    t_pre = bench(pre, args.iters)
    t_dec = bench(dec, args.iters)
    row = dict(kernel="ragged", prefill_len=prefill_len, prefill_ctx=prefill_ctx,
               num_decode=num_decode, decode_ctx=decode_ctx, block_size=bs,
               mixed_ms=t_mixed * 1e3, prefill_ms=t_pre * 1e3, decode_ms=t_dec * 1e3,
               separate_ms=(t_pre + t_dec) * 1e3)
    if getattr(args, "mosaic", False):  # the same mixed launch on the Mosaic GPU kernel
        from pallas_kernels.mosaic_ragged_attention import mosaic_ragged_attention

        try:
            mos = jax.jit(lambda q, k, v, kl, bt, cu, n: mosaic_ragged_attention(
                q, k, v, kl, bt, cu, n, jnp.int32(0), scale=scale))
            row["mosaic_mixed_ms"] = bench(
                lambda: mos(q, k, v, kv_lens, bt, cu, jnp.int32(len(seqs))), args.iters) * 1e3
        except Exception as e:  # recorded: one failing variant must not stop the run
            row["mosaic_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(row))
    return row


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["kernel"] == "decode" and "time_ms" in r]
    batches = sorted({r["batch"] for r in decode})
    bss = sorted({r["block_size"] for r in decode})
    fig, axes = plt.subplots(len(bss), len(batches), squeeze=False,
                             figsize=(4 * len(batches), 3 * len(bss)))
    metric = "pct_of_copy"
    for i, bs in enumerate(bss):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for variant in sorted({r["variant"] for r in decode}):
                pts = sorted((r["context"], r[metric]) for r in decode
                             if r["variant"] == variant and r["batch"] == b
                             and r["block_size"] == bs)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=variant)
            ax.set_xscale("log", base=2)
            ax.set_title(f"batch {b}, block {bs}", fontsize=9)
            ax.set_xlabel("context")
            ax.set_ylabel("% of d2d copy BW")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke sweep, no claims")
    parser.add_argument("--backend", default=None, help="pallas | xla (default: auto)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # "paged" / "contiguous" time Triton's kernels (a Hopper's default is Mosaic since stop
    # 52); "mosaic" calls the Mosaic kernel directly.
    from pallas_kernels.backend import ENV_LOWERING

    os.environ.setdefault(ENV_LOWERING, "triton")

    tag = device_tag()
    smoke = args.quick or tag == "cpu"
    hkv, hq = 8, 32
    if smoke:
        args.backend = "xla"
        args.iters = min(args.iters, 3)
        d, dtype = 64, jnp.float32
        grid = [(b, c, bs) for b in (1, 4) for c in (64, 256) for bs in (16,)]
        variants = ["paged", "contiguous", "xla_ref"]
        ragged_cfg = dict(prefill_len=32, prefill_ctx=96, num_decode=3, decode_ctx=128, bs=16)
        copy_bytes = 1 << 24
    else:
        d, dtype = 128, jnp.bfloat16
        grid = [(b, c, bs) for b in (1, 8, 32, 128) for c in (512, 2048, 8192, 32768)
                for bs in (8, 16, 32)]
        variants = ["paged", "contiguous", "upstream", "xla_ref"]
        ragged_cfg = dict(prefill_len=512, prefill_ctx=2048, num_decode=63, decode_ctx=2048,
                          bs=16)
        copy_bytes = 1 << 30
    copy_gbps = copy_bandwidth(copy_bytes, args.iters)
    label = ("SMOKE RUN (CPU / --quick, xla backend, tiny shapes): validates the harness; "
             "timings are not performance claims" if smoke else f"{tag}, bf16, head_dim {d}")
    print(f"# {label}; d2d copy {copy_gbps:.1f} GB/s")
    rows = run_decode(args, variants, grid, hkv, hq, d, dtype, copy_gbps)
    rows.append(run_ragged(args, hkv, hq, d, dtype, **ragged_cfg))

    out_dir = args.out or RESULTS / tag
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "kernels_quick" if smoke else "kernels"
    meta = dict(label=label, smoke=smoke, device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, backend=args.backend or "auto", copy_gbps=copy_gbps,
                head_dim=d, num_kv_heads=hkv, num_q_heads=hq, dtype=jnp.dtype(dtype).name)
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, out_dir / f"{stem}.png", label)
    print(f"wrote {out_dir / stem}.json/.png")


if __name__ == "__main__":
    main()
