"""Stage ``bench``: the kernel benchmark sweep and a launch-parameter tuning sweep.

1. Decode (``bench/kernels.py``'s variants: our paged kernel, the same kernel over a contiguous
   cache, jax's upstream Pallas ``paged_attention``, on a Hopper our Mosaic GPU kernel, the
   XLA reference): batch 1-256 x context
   1K-32K, bf16, head_dim 128, 8/32 heads, block 16, plus block sizes 8/32 at one point.
   Points whose K+V exceed 20 GiB are dropped; the XLA reference (which gathers K/V into fp32)
   only runs up to 2 GiB. Points run coarse grid first, so a short budget still spans it.
2. Ragged: one mixed launch vs separate prefill + decode launches (run first: two points),
   and on a Hopper the mixed launch on the Mosaic GPU kernel.
3. Tuning: ``num_warps`` x ``num_stages`` x ``pages_per_chunk`` (x ``block_q`` for ragged) for
   each kernel at the two head dims the engine serves (64: demo model, 128: Llama-3-8B),
   bf16, block 16; the best per shape class goes to ``tuning_<device>.json``, rows as
   ``pallas_kernels.tuning`` reads them (``PAGEDJAX_TUNING_FILE``).

Every measured row is appended to ``bench.json`` at once.
"""

from __future__ import annotations

import inspect
import os
import statistics
import types
from collections.abc import Callable
from pathlib import Path

from bench.gpu_suite.common import Budget, Recorder, write_json

GIB = 1 << 30
KV_LIMIT = 20 * GIB
XLA_REF_LIMIT = 2 * GIB


def decode_grid(dry_run: bool) -> list[tuple[int, int, int]]:
    """(batch, context, block_size), coarse points first."""
    if dry_run:
        return [(1, 64, 16), (4, 128, 16)]
    kvb = lambda b, c: 2 * b * c * 8 * 128 * 2  # noqa: E731
    pts = [(b, c, 16) for b in (1, 8, 32, 128, 256) for c in (1024, 2048, 8192, 32768)
           if kvb(b, c) <= KV_LIMIT]
    coarse = lambda p: 0 if p[0] in (1, 32, 128) and p[1] in (2048, 8192) else 1  # noqa: E731
    pts.sort(key=lambda p: (coarse(p), kvb(p[0], p[1])))
    return pts + [(32, 8192, 8), (32, 8192, 32)]


def tuning_classes(dry_run: bool) -> list[dict]:
    """Shape classes: kernel x (head_dim, heads) at the engine's block size 16, bf16."""
    if dry_run:
        return [dict(kernel="decode", head_dim=16, hkv=2, hq=4, dtype="float32", block_size=16,
                     batch=2, context=64),
                dict(kernel="ragged", head_dim=16, hkv=2, hq=4, dtype="float32", block_size=16,
                     prefill_len=16, prefill_ctx=48, num_decode=2, decode_ctx=64)]
    out = []
    for d, hkv, hq in ((128, 8, 32), (64, 3, 9)):
        out.append(dict(kernel="decode", head_dim=d, hkv=hkv, hq=hq, dtype="bfloat16",
                        block_size=16, batch=32, context=4096))
        out.append(dict(kernel="ragged", head_dim=d, hkv=hkv, hq=hq, dtype="bfloat16",
                        block_size=16, prefill_len=512, prefill_ctx=2048, num_decode=31,
                        decode_ctx=2048))
    return out


def tuning_configs(kernel: str, dry_run: bool) -> list[dict]:
    if dry_run:
        return [dict(num_warps=4, num_stages=2, pages_per_chunk=1),
                dict(num_warps=8, num_stages=3, pages_per_chunk=2)]
    ppcs = (1, 2, 4, 8) if kernel == "decode" else (2, 4, 8)
    bqs = (None,) if kernel == "decode" else (32, 64)
    return [dict(num_warps=w, num_stages=s, pages_per_chunk=p, **({"block_q": q} if q else {}))
            for w in (4, 8) for s in (1, 2, 3) for p in ppcs for q in bqs]


def launch_kwargs(fn: Callable, block_size: int, cfg: dict) -> dict:
    """Map a config onto what the kernel entry point accepts (``pages_per_chunk`` or, in newer
    kernels, ``chunk_tokens``), so the sweep survives that rename."""
    params = inspect.signature(fn).parameters
    kw = {k: v for k, v in cfg.items() if k != "pages_per_chunk"}
    ppc = cfg.get("pages_per_chunk")
    if ppc is not None and "pages_per_chunk" in params:
        kw["pages_per_chunk"] = ppc
    elif ppc is not None and "chunk_tokens" in params:
        kw["chunk_tokens"] = ppc * block_size
    return {k: v for k, v in kw.items() if k in params}


def _time_config(cls: dict, cfg: dict, iters: int, inputs) -> float:
    import jax
    import jax.numpy as jnp

    from bench.kernels import bench
    from pallas_kernels import paged_decode_attention, ragged_paged_attention

    scale = cls["head_dim"] ** -0.5
    bs = cls["block_size"]
    if cls["kernel"] == "decode":
        kw = launch_kwargs(paged_decode_attention, bs, cfg)
        f = jax.jit(lambda q, k, v, bt, lens: paged_decode_attention(
            q, k, v, bt, lens, scale=scale, layer=0, backend="pallas", **kw))
        q, k, v, bt, lens = inputs
        return bench(lambda: f(q, k, v, bt, lens), iters)
    kw = launch_kwargs(ragged_paged_attention, bs, cfg)
    f = jax.jit(lambda q, k, v, kl, bt, cu, n: ragged_paged_attention(
        q, k, v, kl, bt, cu, n, scale=scale, layer=0, backend="pallas", **kw))
    q, k, v, kl, bt, cu = inputs
    n = jnp.int32(bt.shape[0])
    return bench(lambda: f(q, k, v, kl, bt, cu, n), iters)


def _class_inputs(cls: dict):
    import jax.numpy as jnp

    from bench.kernels import make_decode_inputs, make_ragged_inputs

    dtype = jnp.dtype(cls["dtype"])
    if cls["kernel"] == "decode":
        return make_decode_inputs(cls["batch"], cls["context"], cls["block_size"], cls["hkv"],
                                  cls["hq"], cls["head_dim"], dtype, contiguous=False)
    seqs = [(cls["prefill_len"], cls["prefill_ctx"])] + [(1, cls["decode_ctx"])] * cls["num_decode"]
    return make_ragged_inputs(cls["hkv"], cls["hq"], cls["head_dim"], dtype, seqs, cls["block_size"])


def tune(rec: Recorder, budget: Budget, dry_run: bool, iters: int, out_dir: Path, tag: str,
         device_kind: str) -> list[dict]:
    """Time every config of every class (default launch first); write the best per class."""
    import jax.numpy as jnp

    from pallas_kernels._common import next_pow2
    from pallas_kernels.tuning import arch_of

    arch = arch_of(device_kind)
    best_rows: list[dict] = []
    tuning_path = out_dir / f"tuning_{tag}.json"
    classes = tuning_classes(dry_run)
    for ci, cls in enumerate(classes):
        cls_budget = budget.sub(1.0 / (len(classes) - ci))
        if not cls_budget.allows(2 if dry_run else 5):
            rec.append("tuning_skipped", {**cls, "reason": "budget"})
            continue
        inputs = _class_inputs(cls)
        results = []
        for cfg in [{}] + tuning_configs(cls["kernel"], dry_run):
            if not cls_budget.allows(0.5 if dry_run else 1.5):
                rec.append("tuning_skipped", {**cls, **cfg, "reason": "budget"})
                break
            row = {**{k: cls[k] for k in ("kernel", "dtype", "head_dim", "block_size")},
                   "group": cls["hq"] // cls["hkv"], "config": cfg or "default"}
            try:
                row["time_ms"] = _time_config(cls, cfg, iters, inputs) * 1e3
            except Exception as e:  # an infeasible config (smem overflow...) is a data point
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rec.append("tuning", row)
            results.append((cfg, row))
        del inputs
        ok = [(c, r) for c, r in results if c and "time_ms" in r]
        if not ok:
            continue
        cfg, row = min(ok, key=lambda cr: cr[1]["time_ms"])
        default = next((r.get("time_ms") for c, r in results if not c), None)
        itemsize = jnp.dtype(cls["dtype"]).itemsize
        best = {"arch": arch, "device_kind": device_kind, "kernel": cls["kernel"],
                "dtype": cls["dtype"], "itemsize": itemsize, "head_dim": cls["head_dim"],
                "block_size": cls["block_size"], "group": cls["hq"] // cls["hkv"],
                "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                "pages_per_chunk": cfg["pages_per_chunk"],
                "chunk_tokens": cfg["pages_per_chunk"] * cls["block_size"],
                "block_q": cfg.get("block_q", 0),
                # tuning.py reads query rows per program (block_q x padded GQA group)
                "q_rows": cfg.get("block_q", 0) * next_pow2(cls["hq"] // cls["hkv"]),
                "time_ms": row["time_ms"],
                "default_time_ms": default, "configs_timed": len(ok),
                "shape": {k: v for k, v in cls.items()
                          if k not in ("kernel", "dtype", "head_dim", "block_size")}}
        best_rows.append(best)
        write_json(tuning_path, best_rows)
        speed = f", {default / best['time_ms']:.2f}x vs default" if default else ""
        rec.summarize(f"tune {cls['kernel']} d{cls['head_dim']} g{best['group']}",
                      f"w{best['num_warps']} s{best['num_stages']} chunk {best['chunk_tokens']}"
                      f"{' bq ' + str(best['block_q']) if best['block_q'] else ''}: "
                      f"{best['time_ms']:.3f} ms{speed}", "info")
    rec.set("tuning_file", tuning_path.name if best_rows else None)
    return best_rows


def run(out_dir: Path, budget: Budget, dry_run: bool, meta: dict) -> Recorder:
    """The stage, with the public kernels pinned to Triton: its "paged", "contiguous" and
    ragged rows are Triton's kernels (on a Hopper the default lowering is Mosaic since stop
    52), and its Mosaic rows call the Mosaic kernels directly."""
    from pallas_kernels.backend import ENV_LOWERING

    old = os.environ.get(ENV_LOWERING)
    os.environ[ENV_LOWERING] = "triton"
    try:
        return _run(out_dir, budget, dry_run, meta)
    finally:
        if old is None:
            os.environ.pop(ENV_LOWERING, None)
        else:
            os.environ[ENV_LOWERING] = old


def _run(out_dir: Path, budget: Budget, dry_run: bool, meta: dict) -> Recorder:
    import jax.numpy as jnp

    from bench import kernels as kb

    rec = Recorder(out_dir, "bench", meta)
    on_gpu = meta["platform"] != "cpu"
    backend = "pallas" if on_gpu else "xla"
    iters = 20 if on_gpu else 3
    args = types.SimpleNamespace(backend=backend, iters=iters)
    hkv, hq = (8, 32) if not dry_run else (2, 4)
    d, dtype = (128, jnp.bfloat16) if not dry_run else (16, jnp.float32)
    copy_gbps = kb.copy_bandwidth((1 << 30) if on_gpu else (1 << 22), iters)
    rec.set("copy_gbps", copy_gbps)
    # The read rate too: attention reads KV and writes little, so its ceiling is this one.
    rec.set("read_gbps", kb.read_bandwidth((1 << 31) if on_gpu else (1 << 22), iters))
    rec.set("decode_shape", {"num_kv_heads": hkv, "num_q_heads": hq, "head_dim": d,
                             "dtype": jnp.dtype(dtype).name, "backend": backend})
    from pallas_kernels.mosaic_decode_attention import hopper_target

    # The Mosaic GPU kernels (issue 21) beside Triton's where the GPU is a Hopper.
    mosaic = on_gpu and hopper_target()
    args.mosaic = mosaic
    variants = ["paged", "contiguous", *(["upstream"] if on_gpu else []),
                *(["mosaic"] if mosaic else []), "xla_ref"]

    ragged_cfgs = ([dict(prefill_len=16, prefill_ctx=48, num_decode=2, decode_ctx=64, bs=16)]
                   if dry_run else
                   [dict(prefill_len=512, prefill_ctx=2048, num_decode=63, decode_ctx=2048, bs=16),
                    dict(prefill_len=128, prefill_ctx=4096, num_decode=127, decode_ctx=4096, bs=16)])
    rag = budget.sub(0.12)
    for rc in ragged_cfgs:
        if not rag.allows(2 if dry_run else 5):
            rec.append("ragged_skipped", rc)
            continue
        try:
            rec.append("ragged", kb.run_ragged(args, hkv, hq, d, dtype, **rc))
        except Exception as e:
            rec.append("ragged", {**rc, "error": f"{type(e).__name__}: {str(e)[:200]}"})

    sweep = budget.sub(0.5)
    dropped = 0
    for batch, ctx, bs in decode_grid(dry_run):
        for v in variants:
            kv = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
            if v == "xla_ref" and on_gpu and kv > XLA_REF_LIMIT:
                continue
            if not sweep.allows(3):
                dropped += 1
                continue
            rec.append("decode", kb.decode_point(args, v, batch, ctx, bs, hkv, hq, d, dtype, copy_gbps))
    rec.set("decode_points_dropped_for_time", dropped)

    tag = meta.get("device_tag", "cpu")
    tune(rec, budget, dry_run, 10 if on_gpu else 2, out_dir, tag, meta["device"])
    _summaries(rec, copy_gbps)
    rec.finish("done")
    return rec


def _summaries(rec: Recorder, copy_gbps: float) -> None:
    rows = [r for r in rec.data.get("decode", []) if "time_ms" in r]
    errors = [r for r in rec.data.get("decode", []) if "error" in r]
    rec.summarize("d2d copy bandwidth", f"{copy_gbps:.0f} GB/s", "info")
    if "read_gbps" in rec.data:
        rec.summarize("device read bandwidth", f"{rec.data['read_gbps']:.0f} GB/s", "info")
    by = {(r["variant"], r["batch"], r["context"], r["block_size"]): r for r in rows}
    paged = [r for r in rows if r["variant"] == "paged"]
    if paged:
        top = max(paged, key=lambda r: r["pct_of_copy"])
        rec.summarize("decode paged, best % of copy BW",
                      f"{top['pct_of_copy']:.0f}% ({top['gbps']:.0f} GB/s) at batch {top['batch']} "
                      f"ctx {top['context']}", "info")
    for other in ("contiguous", "upstream", "mosaic", "xla_ref"):
        ratios = [by[(o, b, c, bs)]["time_ms"] / r["time_ms"] for r in paged
                  for o, b, c, bs in [(other, r["batch"], r["context"], r["block_size"])]
                  if (o, b, c, bs) in by]
        if ratios:
            rec.summarize(f"decode {other} time / paged time",
                          f"median {statistics.median(ratios):.2f}x over {len(ratios)} points "
                          f"(min {min(ratios):.2f}, max {max(ratios):.2f})", "info")
    rec.summarize("decode points measured / errors", f"{len(rows)} / {len(errors)}",
                  "FAIL" if any(e["variant"] == "paged" for e in errors) or not paged else "info")
    for r in rec.data.get("ragged", []):
        if "mixed_ms" in r:
            rec.summarize(f"ragged mixed vs separate ({r['prefill_len']}+{r['num_decode']})",
                          f"{r['mixed_ms']:.3f} vs {r['separate_ms']:.3f} ms", "info")
            if "mosaic_mixed_ms" in r or "mosaic_error" in r:
                rec.summarize(f"ragged mixed, Mosaic vs Triton ({r['prefill_len']}+"
                              f"{r['num_decode']})",
                              f"{r['mosaic_mixed_ms']:.3f} vs {r['mixed_ms']:.3f} ms"
                              if "mosaic_mixed_ms" in r else r["mosaic_error"], "info")
        else:
            rec.summarize("ragged", r.get("error", "?"), "FAIL")
