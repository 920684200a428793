"""A native CPU kernel against its own version at an earlier commit, interleaved (A, B, A, B).

    .venv/bin/python bench/native_ab.py --base COMMIT --kind matmul [--rows 64]
    .venv/bin/python bench/native_ab.py --base COMMIT --kind attention [--seqs 64 --ctx 128]
    .venv/bin/python bench/native_ab.py --base COMMIT --kind lm_head [--rows 64]

Builds the kernel's source file (`pallas_kernels/csrc/dense_matmul_cpu.cc`,
`paged_attention_cpu.cc` or `lm_head_greedy_cpu.cc`) twice, from the working tree and from
``git show COMMIT:...``, each into its own library under its own FFI target, and times one
jitted workload through each:

- `matmul`: the demo model's weight matmuls (30 layers of fused q/k/v, o, fused gate/up and
  down projections, then the LM head: SmolLM2-135M's shapes, random fp32 weights in 64-column
  panels on 2 MiB pages as the engine places them) chained at ``--rows`` rows;
- `attention`: 30 layers of decode attention for ``--seqs`` sequences of ``--ctx`` tokens
  (9 query / 3 KV heads, head dim 64, 16-token blocks) with random block tables over a cache
  twice the size they need, as blocks end up after a while of serving; the cache on 2 MiB
  pages as the engine allocates it (``--small-pages``: XLA's own 4 KiB pages; ``--resident``:
  every sequence and layer reads the same blocks, which stay in cache);
- `lm_head`: the screened greedy LM head (`lm_head_greedy_cpu`) over a head of the demo
  model's shape (49152 x 576, random fp32 weights in 64-column panels with their bfloat16
  pairs and norms from `lm_head_screen`) for ``--rows`` random hidden rows, each leaning on
  one column so that one logit stands out; its tokens are checked against the argmax of the
  float32 logits in float64 numpy.

Both versions must give the same outputs (checked: bit for bit). Reports the median of
``--iters`` interleaved calls each, with the load average at the start; writes
bench/results/cpu/native_ab_<kind>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FILES = {"matmul": ("dense_matmul_cpu.cc", "PagedjaxDenseMatmulCpu"),
         "attention": ("paged_attention_cpu.cc", "PagedjaxRaggedPagedAttentionCpu"),
         "lm_head": ("lm_head_greedy_cpu.cc", "PagedjaxLmHeadGreedyCpu")}


def build(source: str, symbol: str, tag: str, out_dir: Path,
          march: str = "native") -> tuple[ctypes.CDLL, str]:
    """Compile one kernel source into its own library, its handler renamed, for ``-march``
    ``march``; (lib, symbol)."""
    import jax

    from pallas_kernels.cpu_native import FLAGS, _compiler

    FLAGS = tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)

    new = f"{symbol}_{tag}"
    src = out_dir / f"{tag}.cc"
    src.write_text(re.sub(rf"\b{symbol}\b", new, source))
    lib = out_dir / f"{tag}.so"
    subprocess.run([_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    return ctypes.cdll.LoadLibrary(str(lib)), new


def matmul_workload(rows: int):
    """(a function of the FFI target giving the timed call, what the workload is)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.worker.huge_pages import place_on_huge_pages

    rng = np.random.default_rng(0)
    h, inter, layers, vocab = 576, 1536, 30, 49152

    def panels(k, n):
        w = rng.standard_normal((-(-n // 64), k, 64), dtype=np.float32) * 0.05
        return jax.device_put(w)

    def make(target):
        def mm(x, w, n):
            out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
            return jax.ffi.ffi_call(target, out)(x, w)

        @jax.jit
        def chain(x, ws):
            for lp in ws["layers"]:
                x = x + mm(mm(x, lp["qkv"], 960)[:, :h], lp["o"], h)
                x = (x + mm(mm(x, lp["gu"], 2 * inter)[:, :inter], lp["d"], h)) * 0.5
            return mm(x, ws["head"], vocab)[:, :64]
        return chain

    ws = place_on_huge_pages({"layers": [dict(qkv=panels(h, 960), o=panels(h, h),
                                              gu=panels(h, 2 * inter), d=panels(inter, h))
                                         for _ in range(layers)],
                              "head": panels(h, vocab)})

    x = jax.device_put(rng.standard_normal((rows, h), dtype=np.float32))
    flops = 2 * rows * (layers * (h * 960 + h * h + h * 2 * inter + inter * h) + h * vocab)
    def timed(target):
        fn = make(target)
        return lambda: fn(x, ws)

    return timed, {"rows": rows, "gflop_per_call": flops / 1e9}


def lm_head_workload(rows: int):
    """(a function of the FFI target giving the timed call, the workload)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.cpu_native import lm_head_screen

    rng = np.random.default_rng(0)
    h, vocab = 576, 49152
    w = rng.standard_normal((vocab // 64, h, 64), dtype=np.float32) * 0.05
    screen = lm_head_screen(w, vocab, "bf16")  # the bfloat16 target's builds are compared
    bf16, norms, panels = (jax.device_put(a) for a in (screen["bf16"], screen["norms"], w))
    # Rows leaning on one column each (6 times it, on unit noise), so that as with a trained
    # model's hidden states one logit stands out (by ~3 of the others' spread) and few columns
    # pass the screen. Pure noise would make the top logits near ties, hundreds of candidates
    # a row, and time their float32 recomputation more than the screen.
    cols = rng.integers(0, vocab, rows)
    x = (rng.standard_normal((rows, h)) + 6 * w[cols // 64, :, cols % 64]).astype(np.float32)
    logits = x.astype(np.float64) @ w.transpose(1, 0, 2).reshape(h, vocab).astype(np.float64)
    want = logits.argmax(axis=1)
    xd = jax.device_put(x)

    def timed(target):
        fn = jax.jit(lambda x: jax.ffi.ffi_call(
            target, jax.ShapeDtypeStruct((rows,), jnp.int32))(x, bf16, norms, panels))
        got = np.asarray(fn(xd))
        if not np.array_equal(got, want):  # float32 and float64 may differ on a near tie only
            top2 = np.sort(logits, axis=1)[:, -2:]
            close = np.abs(top2[:, 1] - top2[:, 0]) < 1e-4 * np.abs(top2[:, 1])
            if not np.all((got == want) | close):
                sys.exit(f"{target}: tokens differ from the float64 argmax")
        return lambda: fn(xd)

    return timed, {"rows": rows, "head": [vocab, h]}


def attention_workload(seqs: int, ctx: int, small_pages: bool, resident: bool = False):
    """(a function of the FFI target (and page size) giving the timed call, the workload)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.cpu_native import zeros_on_huge_pages

    layers, hkv, group, d, bs = 30, 3, 3, 64, 16
    per = -(-ctx // bs)
    n = max(2 * seqs * per, 2048)
    shape = (layers, hkv, n, bs, d)
    rng = np.random.default_rng(0)
    fill = jax.jit(lambda c, x: c + x, donate_argnums=0)
    values = jnp.asarray(rng.standard_normal(shape[2:], dtype=np.float32))
    caches = {}

    def cache_pair(small: bool):
        if small not in caches:
            make_zeros = jnp.zeros if small else zeros_on_huge_pages
            caches[small] = [fill(make_zeros(shape, jnp.float32), values) for _ in range(2)]
        return caches[small]
    tables = np.zeros((seqs, 64), np.int32)
    tables[:, :per] = (np.arange(per) if resident else  # every sequence the same blocks
                       rng.permutation(n)[:seqs * per].reshape(seqs, per))
    kv_lens, cu = jnp.full((seqs,), ctx, jnp.int32), jnp.arange(seqs + 1, dtype=jnp.int32)
    q = jax.device_put(rng.standard_normal((seqs, hkv * group, d), dtype=np.float32))

    def make(target):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))

        @jax.jit
        def run(q, k, v, tables):
            out = q
            for layer in range(layers):
                out = out + call(out, k, v, kv_lens, tables, cu, jnp.int32(seqs),
                                 jnp.int32(0 if resident else layer), jnp.int32(0),
                                 jnp.zeros((0,), jnp.float32),
                                 scale=np.float32(0.125), softcap=np.float32(0),
                                 data_slots=np.int64(0))
            return out
        return run

    t = jnp.asarray(tables)
    gb = seqs * per * bs * d * 4 * 2 * hkv * layers / 1e9
    def timed(target, small: bool = small_pages):
        fn = make(target)
        k, v = cache_pair(small)
        return lambda: fn(q, k, v, t)

    return timed, {
        "seqs": seqs, "ctx": ctx, "kv_gb_per_call": gb,
        "cache_gb": 2 * float(np.prod(shape)) * 4 / 1e9,
        "cache_pages": "4 KiB" if small_pages else "2 MiB", "cache_resident": resident}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="the commit to compare against")
    ap.add_argument("--pages", action="store_true",
                    help="attention: the working tree's kernel on a cache of 4 KiB pages "
                         "against one of 2 MiB pages (no --base)")
    ap.add_argument("--kind", choices=sorted(FILES), required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--small-pages", action="store_true")
    ap.add_argument("--resident", action="store_true",
                    help="attention: every sequence and layer reads the same blocks (they "
                         "stay in cache: the arithmetic alone)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--march", default="native",
                    help="-march for the working tree's build (x86-64-v3: the AVX2 paths)")
    ap.add_argument("--base-march", default=None,
                    help="-march for the base's build (default: --march); when the two "
                         "differ, outputs are compared to float rounding, not bit for bit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    import jax
    import numpy as np

    if args.pages != (args.base is None) or (args.pages and args.kind != "attention"):
        ap.error("give --base COMMIT, or --pages with --kind attention")
    marches = {"tree": args.march, "base": args.base_march or args.march}
    name, symbol = FILES[args.kind]
    rel = f"pallas_kernels/csrc/{name}"
    sources = {"tree": (ROOT / rel).read_text()}
    base_commit = None
    if args.base:
        base_commit = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT,
                                     check=True, capture_output=True, text=True).stdout.strip()
        sources["base"] = subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=ROOT,
                                         check=True, capture_output=True, text=True).stdout
    if args.kind == "matmul":
        timed, meta = matmul_workload(args.rows)
    elif args.kind == "lm_head":
        timed, meta = lm_head_workload(args.rows)
    else:
        timed, meta = attention_workload(args.seqs, args.ctx, args.small_pages, args.resident)
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tag, src in sources.items():
            lib, sym = build(src, symbol, tag, Path(tmp), marches[tag])
            target = f"native_ab_{args.kind}_{tag}"
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)),
                                        platform="cpu")
            if args.pages:
                calls["small_pages"] = timed(target, True)
                calls["huge_pages"] = timed(target, False)
            else:
                calls[tag] = timed(target)
        outs = [np.asarray(f()) for f in calls.values()]
        identical = bool(np.array_equal(outs[0], outs[1]))
        max_diff = float(np.max(np.abs(outs[0].astype(np.float64) - outs[1])))
        times = {tag: [] for tag in calls}
        for _ in range(args.iters):
            for tag, f in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                times[tag].append(time.perf_counter() - t0)
    ms = {tag: 1e3 * float(np.median(v)) for tag, v in times.items()}
    new, old = ("huge_pages", "small_pages") if args.pages else ("tree", "base")
    what = (f"the working tree's {rel} against {base_commit}'s" if base_commit else
            "the working tree's kernel on a KV cache of 4 KiB pages and of 2 MiB pages")
    res = {"what": f"{args.kind}: {what}, median ms per call of interleaved calls "
                   "(bench/native_ab.py)",
           "command": "python bench/native_ab.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "cpu_count": os.cpu_count(), "load_avg_1m_at_start": load},
           "versions": {"jax": jax.__version__}, "workload": meta, "base": base_commit,
           "march": marches, "ms": ms, f"{new}_over_{old}_speed": ms[old] / ms[new],
           "outputs_identical": identical, "outputs_max_abs_diff": max_diff,
           "ms_all": times}
    if "gflop_per_call" in meta:
        res["gflop_per_s"] = {k: meta["gflop_per_call"] / v * 1e3 for k, v in ms.items()}
    if "kv_gb_per_call" in meta:
        res["kv_gb_per_s"] = {k: meta["kv_gb_per_call"] / v * 1e3 for k, v in ms.items()}
    out = Path(args.out or ROOT / f"bench/results/cpu/native_ab_{args.kind}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("what", "ms_all")}, indent=1))
    same_isa = marches["tree"] == marches["base"]
    if not identical and (same_isa or not np.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)):
        sys.exit("outputs differ between the two versions")


if __name__ == "__main__":
    main()
