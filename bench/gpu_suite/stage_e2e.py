"""Stage ``e2e``: engine correctness against CPU goldens, then full-size serving performance.

Part 1 (about half the budget): for each golden model (SmolLM2-135M shapes; Llama-3-8B layer
shapes with 2 layers) the plan of :mod:`bench.gpu_suite.goldens` in fp32 (matmul precision
"highest", so TF32 cannot hide in the comparison) and bf16 with ``attention_backend="pallas"``:
chunked prefill, recompute and swap preemption, prefix caching and beam search, each checked
against ``tests/data/gpu_goldens/<model>.json``. A weights fingerprint is checked first, so a
numpy that draws other numbers is reported as such, not as an engine bug.

Part 2: Llama-3-8B shapes (32 layers, device-drawn random weights, bf16, no goldens):
decode step time vs the roofline (weights + KV bytes at the measured read bandwidth; until the
sixth run, at the copy's read + write rate, which the step beat),
the same under the other attention lowering and layer loop, offline throughput on
ShareGPT-like lengths, async scheduling on / off and seeded sampled requests with the
two-stage / one-stage top-k (one warm engine, interleaved, tokens compared), and TTFT /
inter-token latency under Poisson arrivals. Steps that compiled are counted and their time
reported, not hidden.

``--dry-run``: the tiny model on CPU, goldens computed in-process, XLA attention.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_suite import goldens as G
from bench.gpu_suite.common import Budget, Recorder
from bench.gpu_suite.seeded import SPECS, NoTokenizer, device_random_params, fingerprint, seeded_params

# Expected seconds for one (model, dtype) plan on an H100, compile included (guesses until a
# GPU run measures them; the stage records the real figure in ``wall_s``).
PLAN_COST_S = {"demo": 50, "llama3_8b_2l": 60, "tiny": 5}


def _one_side(mosaic_ms: float | None, triton_ms: float | None) -> str:
    """A lowering A/B row where one side has no time: the default lowering's own point was
    cut by the budget (the eighth run's b32 x 4096), not a failure of the kernel."""
    def fmt(v: float | None) -> str:
        return "not timed (the default's point was cut)" if v is None else f"{v:.2f} ms"
    return f"mosaic {fmt(mosaic_ms)}, triton {fmt(triton_ms)}"


@contextlib.contextmanager
def _env(name: str, value: str):
    """``$name`` set to ``value`` inside, restored (or removed) after: the A/B parts' switches
    are read when an engine is built or traced."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _cast(params: dict, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    return params if dtype == "float32" else jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)


def plan_order(dry_run: bool) -> list[tuple[str, str]]:
    """(model, dtype) pairs, most informative first, so a short budget drops the least."""
    if dry_run:
        return [("tiny", "float32"), ("tiny", "bfloat16")]
    return [("demo", "float32"), ("llama3_8b_2l", "bfloat16"), ("demo", "bfloat16"),
            ("llama3_8b_2l", "float32")]


def correctness(rec: Recorder, budget: Budget, dry_run: bool, backend: str) -> None:
    import jax

    goldens: dict[str, dict | None] = {}
    params: dict[str, dict] = {}
    for name, dtype in plan_order(dry_run):
        key = f"{name}/{dtype}"
        spec = SPECS[name]
        if not budget.allows(PLAN_COST_S[name]):
            rec.summarize(f"goldens {key}", "not run: out of time", "skipped")
            continue
        if name not in goldens:
            if dry_run:
                params[name] = seeded_params(spec.config, spec.seed)
                goldens[name] = G.compute_golden(spec, params[name])
            else:
                goldens[name] = G.load_golden(name)
                fp = fingerprint(spec.config, spec.seed)
                if fp != goldens[name]["fingerprint"]:
                    rec.summarize(f"goldens {name}", f"weights differ from the golden's ({fp} vs "
                                  f"{goldens[name]['fingerprint']}): numpy stream changed?", "FAIL")
                    goldens[name] = None
        golden = goldens[name]
        if golden is None:
            continue
        if name not in params:  # both models' fp32 weights fit beside each other (~7 GB)
            params[name] = seeded_params(spec.config, spec.seed)
        partial: dict[str, Any] = {}

        def on_result(run: str, res: dict, key=key, partial=partial) -> None:
            partial[run] = res
            rec.data.setdefault("goldens", {})[key] = dict(partial)
            rec.save()

        try:
            prec = (jax.default_matmul_precision("highest") if dtype == "float32"
                    else contextlib.nullcontext())
            with prec:
                res = G.run_plan(spec, _cast(params[name], dtype), golden, dtype, backend, on_result)
        except Exception as e:  # one failing plan must not stop the others
            err = f"{type(e).__name__}: {e}"[:400]
            rec.data.setdefault("goldens", {})[key] = {**partial, "error": err}
            rec.summarize(f"goldens {key}", f"error: {type(e).__name__}: {str(e)[:80]}", "FAIL")
            continue
        rec.data.setdefault("goldens", {})[key] = res
        rec.save()
        _summarize_plan(rec, key, res)


def _summarize_plan(rec: Recorder, key: str, res: dict) -> None:
    s = res["score"]
    rec.summarize(f"{key} logprobs (top-8)",
                  f"max |d| {s['max_abs_diff']:.2g} (tol {s['tol']:.2g}), {s['violations']} violations, "
                  f"top-1 {s['top1_decisive']:.1%} decisive / {s['top1_raw']:.1%} raw",
                  "pass" if s["ok"] else "FAIL")
    for mode in ("recompute", "swap"):
        g, f = res[f"greedy_{mode}"], res[f"greedy_{mode}"]["features"]
        rec.summarize(f"{key} greedy, {mode}",
                      f"{g['tokens_matched']}/{g['tokens']} tokens before divergence, "
                      f"{len(g['unexplained'])} unexplained; preempt {f['preemptions']} "
                      f"swap {f['blocks_swapped_out']} prefix-hit {f['prefix_hit_tokens']} "
                      f"chunks {f['partial_prompt_chunks']}", "pass" if g["ok"] else "FAIL")
    b = res["beam"]
    rec.summarize(f"{key} beam search",
                  f"{sum(x['identical'] for x in b['beams'])}/{len(b['beams'])} identical, max |d cum| "
                  f"{max(x['abs_diff'] for x in b['beams']):.2g}, copies {b['features']['blocks_copied']}",
                  "pass" if b["ok"] else "FAIL")


# ---- part 2: full-size performance -------------------------------------------------------------
def _serve(engine, reqs: list, budget: Budget, rate_based: bool) -> dict[str, Any]:
    """Serve ``bench.workloads.Request``s (arrival offsets honoured when ``rate_based``); per-step
    times and compile flags, per-request first-token time and token times."""
    from pagedjax import SamplingParams
    from pagedjax.worker.compile_stats import num_backend_compiles

    pending = sorted(reqs, key=lambda r: r.arrival)
    arrival, token_times, ntok = {}, {}, {}
    steps = []
    t0 = time.monotonic()
    i = 0
    aborted = False
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(pending) and (not rate_based or pending[i].arrival <= now):
            r = pending[i]
            rid = str(r.index)
            engine.add_request(rid, None, SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                                                         temperature=0.0),
                               prompt_token_ids=r.prompt_token_ids)
            arrival[rid] = time.monotonic() - t0
            token_times[rid], ntok[rid] = [], 0
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, pending[i].arrival - now)))
            continue
        if not budget.allows(0):
            engine.abort_request([str(r.index) for r in pending[:i]])
            engine.step()
            aborted = True
            break
        c0 = num_backend_compiles()
        s0 = time.monotonic()
        outs = engine.step()
        s1 = time.monotonic()
        steps.append((s1 - s0, num_backend_compiles() != c0, engine.last_step_tokens))
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if n > ntok.get(o.request_id, 0):
                token_times[o.request_id].extend([s1 - t0] * (n - ntok[o.request_id]))
                ntok[o.request_id] = n
    wall = time.monotonic() - t0
    ttft = [token_times[r][0] - arrival[r] for r in token_times if token_times[r]]
    itl = [b - a for r in token_times for a, b in zip(token_times[r], token_times[r][1:])]
    compiled = [s for s in steps if s[1]]
    out_tokens = sum(ntok.values())
    prompt_tokens = sum(len(r.prompt_token_ids) for r in pending[:i])
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else math.nan  # noqa: E731
    return {"requests_added": i, "requests": len(reqs), "aborted_at_deadline": aborted,
            "wall_s": wall, "steps": len(steps), "output_tokens": out_tokens,
            "prompt_tokens": prompt_tokens, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + prompt_tokens) / wall,
            "compile_steps": len(compiled), "compile_step_s": sum(s[0] for s in compiled),
            "output_tok_s_excl_compile_steps": out_tokens / max(1e-9, wall - sum(s[0] for s in compiled)),
            "step_ms_median": 1e3 * statistics.median([s[0] for s in steps if not s[1]] or [math.nan]),
            "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "itl_ms": {"p50": 1e3 * pct(itl, 50), "p90": 1e3 * pct(itl, 90), "p99": 1e3 * pct(itl, 99)}}


def _set_async(engine, on: bool) -> None:
    """Async scheduling on or off on an idle engine: the runner's `feed_tokens` decides whether
    `LLMEngine.step` leaves the launched step in flight (async) or finishes it before returning
    (sync). The step's compiled form is the same either way (on one device every step merges
    pending tokens into its ids, none when sync: `ModelRunner._make_serve_step`), so one warm
    engine compares both without a second 8B engine's compiles."""
    if engine.has_unfinished_requests():
        raise RuntimeError("async A/B: the engine still has requests")
    engine.runner.feed_tokens = on


def _set_chunked_top_k(engine, on: bool) -> None:
    """The GPU sampler's two-stage top-k (`pagedjax/chunked_top_k.py`) on or off: the engine
    passes `runner.chunked_top_k` to `sample` at every call (a static argument, so each
    setting has its own compiled sampler, warmed by `_mode_ab`'s untimed runs)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("top-k A/B: the engine still has requests")
    engine.runner.chunked_top_k = on


def _mode_ab(engine, reqs: list, budget: Budget, max_tokens: int, modes: tuple[str, str],
             switch, params) -> dict[str, Any]:
    """The same requests served in two modes of one warm engine, interleaved (A, B, A, B):
    ``switch(engine, mode)`` sets a mode on the idle engine, ``params(r)`` gives a request's
    `SamplingParams` (seeded where sampled, so both modes must give the same tokens). Output
    tokens per second of each mode's median run, compile steps excluded, and whether every
    run produced the same tokens; the engine's own setting is restored."""
    from pagedjax.worker.compile_stats import num_backend_compiles

    runs, tokens = [], {}

    def serve(tag: str) -> tuple[dict[str, list[int]], float, int, float]:
        got: dict[str, list[int]] = {}
        for r in reqs:
            engine.add_request(f"{tag}-{r.index}", None, params(r),
                               prompt_token_ids=r.prompt_token_ids)
        c0, compile_s, t0 = num_backend_compiles(), 0.0, time.monotonic()
        while engine.has_unfinished_requests():
            c, s0 = num_backend_compiles(), time.monotonic()
            for o in engine.step():
                if o.finished:
                    got[o.request_id.split("-", 1)[1]] = list(o.outputs[0].token_ids)
            if num_backend_compiles() != c:
                compile_s += time.monotonic() - s0
        return got, time.monotonic() - t0, num_backend_compiles() - c0, compile_s

    try:
        # Untimed, the timed run itself once per mode: the scheduler repeats its steps, so
        # every step and sampler shape is compiled before the timing; a compile step left
        # is excluded from its run's rate (`compile_s`).
        for mode in modes:
            switch(engine, mode)
            serve(f"abwarm{mode}")
        for rnd in range(2):
            for mode in modes:
                if not budget.allows(0):
                    break
                switch(engine, mode)
                got, wall, compiles, compile_s = serve(f"ab{rnd}{mode}")
                n = sum(len(v) for v in got.values())
                runs.append({"round": rnd, "mode": mode, "wall_s": wall, "output_tokens": n,
                             "compiles": compiles, "compile_s": compile_s,
                             "tok_s": n / max(1e-9, wall - compile_s)})
                tokens.setdefault(mode, []).append(got)
    finally:
        if not engine.has_unfinished_requests():
            switch(engine, None)
    res: dict[str, Any] = {"requests": len(reqs), "max_tokens": max_tokens, "runs": runs}
    if set(modes) <= set(tokens):
        every = [g for mode in tokens.values() for g in mode]
        res["identical"] = all(g == every[0] for g in every[1:])
        res["tok_s"] = {m: statistics.median(r["tok_s"] for r in runs if r["mode"] == m)
                        for m in modes}
        res["ratio"] = res["tok_s"][modes[0]] / res["tok_s"][modes[1]]
    return res


def _async_ab(engine, reqs: list, budget: Budget, max_tokens: int) -> dict[str, Any]:
    """Greedy requests with async scheduling on and off (`_mode_ab`); sync mode's ids reach
    the step as a host array, not a device one, and compile anew (3 compilations in the CPU
    dry run), which the untimed runs cover."""
    from pagedjax import SamplingParams

    default = engine.runner.feed_tokens
    res = _mode_ab(engine, reqs, budget, max_tokens, ("async", "sync"),
                   lambda e, m: _set_async(e, default if m is None else m == "async"),
                   lambda r: SamplingParams(max_tokens=min(r.output_len, max_tokens),
                                            ignore_eos=True, temperature=0.0))
    res["default_async"] = bool(default)
    if "ratio" in res:
        res["async_over_sync"] = res.pop("ratio")
    return res


def _top_k_ab(engine, reqs: list, budget: Budget, max_tokens: int) -> dict[str, Any]:
    """Seeded sampled requests (temperature 0.8, top-p 0.95, top-k 50 on every other one, the
    top 5 logprobs on every third) with the two-stage top-k and with one `lax.top_k`
    (`_mode_ab`): the engine-level gain of `chunked_top_k` and the same tokens."""
    from pagedjax import SamplingParams

    default = engine.runner.chunked_top_k
    res = _mode_ab(engine, reqs, budget, max_tokens, ("chunked", "one_stage"),
                   lambda e, m: _set_chunked_top_k(e, default if m is None else m == "chunked"),
                   lambda r: SamplingParams(max_tokens=min(r.output_len, max_tokens),
                                            ignore_eos=True, temperature=0.8, top_p=0.95,
                                            top_k=50 if r.index % 2 else -1,
                                            logprobs=5 if r.index % 3 == 0 else None,
                                            seed=1000 + r.index))
    res["default_chunked"] = bool(default)
    if "ratio" in res:
        res["chunked_over_one_stage"] = res.pop("ratio")
    return res


def decode_step_inputs(runner, batch: int, ctx: int):
    """The inputs of one decode step of ``batch`` sequences at context ``ctx``, each on blocks
    of its own."""
    from pagedjax.core.scheduler import ScheduledSeq
    from pagedjax.worker.step_inputs import build_step_inputs

    bs = runner.block_size
    per = -(-ctx // bs)
    seqs = [ScheduledSeq(i, str(i), [7], ctx - 1, list(range(i * per, (i + 1) * per)), True)
            for i in range(batch)]
    return build_step_inputs(seqs, bs, runner.max_blocks_per_seq,
                             num_groups=runner.num_kv_groups)


def _decode_step_ms(runner, batch: int, ctx: int, iters: int, pipelined: bool = False) -> float:
    """Time of one decode step of ``batch`` sequences at context ``ctx`` (disjoint blocks):
    the median with a wait after each step, or with ``pipelined`` the device's time per step
    dispatched back to back (`bench.kernels.bench`), what async scheduling can reach."""
    from bench.kernels import bench

    inputs = decode_step_inputs(runner, batch, ctx)
    # By default per call, with a wait after each (as every run before the seventh timed the
    # step); the warm-up compiles.
    return bench(lambda: runner.execute(inputs), iters, warmup=1, pipelined=pipelined)


def performance(rec: Recorder, budget: Budget, dry_run: bool, backend: str) -> None:
    import jax.numpy as jnp

    from bench.kernels import copy_bandwidth, read_bandwidth
    from bench.workloads import make_requests
    from pagedjax import LLM
    from pagedjax.worker.model_runner import kv_bytes_per_block

    spec = SPECS["tiny" if dry_run else "llama3_8b"]
    cfg = spec.config
    dtype = jnp.bfloat16
    if not budget.allows(60 if not dry_run else 5):
        rec.summarize(f"perf {spec.name}", "not run: out of time", "skipped")
        return
    copy_gbps = copy_bandwidth((1 << 22) if dry_run else (1 << 30), 3 if dry_run else 20)
    read_gbps = read_bandwidth((1 << 22) if dry_run else (1 << 31), 3 if dry_run else 20)
    num_blocks, max_seqs = (64, 8) if dry_run else (8192, 128)
    mml = 256 if dry_run else 2048
    t0 = time.monotonic()
    params = device_random_params(cfg, spec.seed, dtype)
    llm = LLM.from_params(cfg, params, NoTokenizer(), attention_backend=backend, block_size=16,
                          num_gpu_blocks=num_blocks, max_num_seqs=max_seqs,
                          max_num_batched_tokens=512 if dry_run else 2048, max_model_len=mml,
                          enable_chunked_prefill=True, warmup=False,
                          # The A/B parts rerun the offline part's requests: no prefix hits,
                          # as in the runs before prefix caching became the default (stop 57).
                          enable_prefix_caching=False)
    eng = llm.engine
    kv_tok = kv_bytes_per_block(cfg, 16, dtype) / 16
    # Decode reads every weight but the embedding table (a gather of B rows).
    w_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for k, a in _flat(params).items()
                  if k != "embed" or cfg.tie_word_embeddings)
    rec.set("perf", {"model": spec.name, "about": spec.about, "dtype": "bfloat16",
                     "copy_gbps": copy_gbps, "read_gbps": read_gbps,
                     "weight_bytes_read_per_step": w_bytes,
                     "kv_bytes_per_token": kv_tok, "num_gpu_blocks": num_blocks,
                     "max_num_seqs": max_seqs, "max_model_len": mml,
                     "setup_s": time.monotonic() - t0})
    perf = rec.data["perf"]

    roof = budget.sub(0.2)
    # (64, 1024) first and always: the first H100 run's short budget measured none, and that
    # point is the one to compare between layer loops ($PAGEDJAX_LAYER_LOOP, docs/gpu.md).
    points = [(4, 64), (1, 32)] if dry_run else [(64, 1024), (1, 1024), (16, 1024), (128, 1024), (32, 4096)]
    perf["layer_loop"] = "scan" if eng.runner.scan_layers else "unrolled"
    from pallas_kernels.backend import pallas_lowering, target_compute_capability

    # The attention lowering the main engine traced with ("auto": Mosaic on a Hopper).
    perf["lowering"], perf["compute_capability"] = pallas_lowering(), target_compute_capability()

    def other_layer_loop() -> None:
        """The first point under the other layer loop, on the same warm device, right after the
        default's: the scan copied each layer's weights before its GEMMs (docs/gpu.md), which
        unrolling removes. The first H200 run measured this after all points and ran out of budget."""
        other = "scan" if perf["layer_loop"] == "unrolled" else "unrolled"
        # The stage's budget, not the roofline points' share: at --budget-s 200 that share was
        # 40 s and the first point's compile spent it (H200, 2026-11-27: not measured again).
        if not budget.allows(45 if not dry_run else 1):
            rec.summarize(f"{spec.name} decode: {other} layer loop", "not run: out of time", "skipped")
            return
        b, c = points[0]
        alt = LLM.from_params(cfg, params, NoTokenizer(), attention_backend=backend, block_size=16,
                              num_gpu_blocks=b * -(-c // 16) + 16, max_num_seqs=b,
                              max_num_batched_tokens=512 if dry_run else 2048, max_model_len=mml,
                              layer_loop=other, warmup=False)
        ms = _decode_step_ms(alt.engine.runner, b, c, 3 if dry_run else 10) * 1e3
        del alt
        gc.collect()
        base = perf["decode_vs_roofline"][0]["step_ms"]
        perf["other_layer_loop"] = {"layer_loop": other, "batch": b, "context": c, "step_ms": ms,
                                    "default_step_ms": base}
        rec.save()
        rec.summarize(f"{spec.name} decode b{b} ctx{c}: {other} / {perf['layer_loop']}",
                      f"{ms:.2f} vs {base:.2f} ms ({ms / base:.2f}x)", "info")

    def other_lowering() -> None:
        """Decode steps of the whole model with the attention lowering the default did not
        pick (``PAGEDJAX_PALLAS_LOWERING``, read when the step is traced): Triton's kernels
        where the default is Mosaic (a Hopper, since stop 52), Mosaic's elsewhere, on the same
        warm device. Points: the first and the KV-heavy one."""
        from pallas_kernels.backend import ENV_LOWERING

        other = "triton" if perf["lowering"] == "mosaic" else "mosaic"
        if not budget.allows(60 if not dry_run else 1):
            rec.summarize(f"{spec.name} decode: {other} lowering", "not run: out of time",
                          "skipped")
            return
        pts = [points[0], points[-1]]
        b_max = max(b for b, _ in pts)
        rows, alt = [], None
        try:
            # The CPU dry run interprets both kernels (its main engine runs XLA attention).
            # The lowering is read when a step is traced: the timed calls stay inside.
            with _env(ENV_LOWERING, other):
                alt = LLM.from_params(cfg, params, NoTokenizer(), attention_backend="pallas",
                                      block_size=16,
                                      num_gpu_blocks=max(b * -(-c // 16) for b, c in pts) + 16,
                                      max_num_seqs=b_max,
                                      max_num_batched_tokens=512 if dry_run else 2048,
                                      max_model_len=mml, warmup=False)  # as the main engine
                for b, c in pts:
                    if rows and not budget.allows(20 if not dry_run else 0):
                        break
                    ms = _decode_step_ms(alt.engine.runner, b, c, 3 if dry_run else 10) * 1e3
                    rows.append({"batch": b, "context": c, f"{other}_step_ms": ms})
        except Exception as e:  # noqa: BLE001 -- recorded; the rest of the stage still runs
            # The fifth run (H200) failed here ("Input buffer 2 is not 256-byte aligned") and
            # took every later part of the stage with it.
            perf["other_lowering_error"] = f"{type(e).__name__}: {e}"[:2000]
            rec.summarize(f"{spec.name} decode: {other} lowering",
                          perf["other_lowering_error"][:200], "FAIL")
        del alt
        gc.collect()
        perf["mosaic_lowering"] = rows  # the name of the fifth run's files
        rec.save()

    def other_norm() -> None:
        """Decode steps with the residual add + RMSNorm the default did not pick
        (``PAGEDJAX_FUSED_NORM``, read when the runner is built): XLA's where the default is
        a fused one (the Pallas kernel on one GPU, since stop 66: fewer launches at batch 1,
        docs/gpu.md; the native call on one CPU device, since stop 83), the Pallas kernel
        elsewhere. Points: batch 1 (what it is for) and the first (64)."""
        from pagedjax.worker.model_runner import ENV_FUSED_NORM

        perf["fused_norm"] = eng.runner.model.norm_fn is not None
        if not budget.allows(60 if not dry_run else 1):
            rec.summarize(f"{spec.name} decode: the other norm", "not run: out of time",
                          "skipped")
            return
        pts = [p for p in points if p[0] == 1][:1] + [points[0]]
        rows, alt = [], None
        try:
            # Read when the runner is built; the steps then trace with its norm_fn.
            with _env(ENV_FUSED_NORM, "0" if perf["fused_norm"] else "1"):
                alt = LLM.from_params(cfg, params, NoTokenizer(), attention_backend=backend,
                                      block_size=16,
                                      num_gpu_blocks=max(b * -(-c // 16) for b, c in pts) + 16,
                                      max_num_seqs=max(b for b, _ in pts),
                                      max_num_batched_tokens=512 if dry_run else 2048,
                                      max_model_len=mml, warmup=False)
            for b, c in pts:
                if rows and not budget.allows(20 if not dry_run else 0):
                    break
                ms = _decode_step_ms(alt.engine.runner, b, c, 3 if dry_run else 10) * 1e3
                pipe = _decode_step_ms(alt.engine.runner, b, c, 3 if dry_run else 8,
                                       pipelined=True) * 1e3
                rows.append({"batch": b, "context": c, "other_step_ms": ms,
                             "other_pipelined_step_ms": pipe})
        except Exception as e:  # noqa: BLE001 -- recorded; the rest of the stage still runs
            perf["other_norm_error"] = f"{type(e).__name__}: {e}"[:2000]
            rec.summarize(f"{spec.name} decode: the other norm", perf["other_norm_error"][:200],
                          "FAIL")
        del alt
        gc.collect()
        default = {(r["batch"], r["context"]): r for r in perf["decode_vs_roofline"]}
        for r in rows:
            d = default.get((r["batch"], r["context"]), {})
            r["default_step_ms"] = d.get("step_ms")
            r["default_pipelined_step_ms"] = d.get("pipelined_step_ms")
            fused, plain = ((r["default_step_ms"], r["other_step_ms"]) if perf["fused_norm"]
                            else (r["other_step_ms"], r["default_step_ms"]))
            r["fused_over_xla"] = fused / plain if fused and plain else None
            rec.summarize(f"{spec.name} decode b{r['batch']} ctx{r['context']}: fused norm / "
                          f"XLA's", f"{fused} vs {plain} ms" if r["fused_over_xla"] is None
                          else f"{fused:.2f} vs {plain:.2f} ms ({r['fused_over_xla']:.3f}x)",
                          "info")
        perf["fused_norm_ab"] = rows
        rec.save()

    perf["decode_vs_roofline"] = []
    for b, c in points:
        if perf["decode_vs_roofline"] and not roof.allows(20 if not dry_run else 1):
            break
        ms = _decode_step_ms(eng.runner, b, c, 3 if dry_run else 10) * 1e3
        step_bytes = w_bytes + b * c * kv_tok
        roof_ms = step_bytes / (read_gbps * 1e9) * 1e3
        copy_ms = step_bytes / (copy_gbps * 1e9) * 1e3  # the first five runs' reference
        # The same step back to back: its device time without the per-step wait.
        pipe_ms = _decode_step_ms(eng.runner, b, c, 3 if dry_run else 8, pipelined=True) * 1e3
        perf["decode_vs_roofline"].append({"batch": b, "context": c, "step_ms": ms, "roofline_ms": roof_ms,
                                           "pct_of_roofline": 100 * roof_ms / ms,
                                           "step_read_gbps": step_bytes / ms / 1e6,
                                           "pipelined_step_ms": pipe_ms,
                                           "copy_roofline_ms": copy_ms})
        rec.save()
        if len(perf["decode_vs_roofline"]) == 1:
            other_layer_loop()
    if perf["decode_vs_roofline"]:
        other_norm()
        other_lowering()
        default = {(r["batch"], r["context"]): r["step_ms"] for r in perf["decode_vs_roofline"]}
        for r in perf.get("mosaic_lowering", []):
            r[f"{perf['lowering']}_step_ms"] = default.get((r["batch"], r["context"]))
            mo, tr = r.get("mosaic_step_ms"), r.get("triton_step_ms")
            rec.summarize(f"{spec.name} decode b{r['batch']} ctx{r['context']}: mosaic / triton",
                          f"{mo:.2f} vs {tr:.2f} ms ({mo / tr:.2f}x)" if mo and tr
                          else _one_side(mo, tr), "info")
        rec.save()
    for r in perf["decode_vs_roofline"]:
        rec.summarize(f"{spec.name} decode b{r['batch']} ctx{r['context']} ({perf['layer_loop']})",
                      f"{r['step_ms']:.2f} ms vs roofline {r['roofline_ms']:.2f} ms "
                      f"({r['pct_of_roofline']:.0f}%; {r['step_read_gbps']:.0f} of "
                      f"{perf['read_gbps']:.0f} GB/s read); back to back "
                      f"{r['pipelined_step_ms']:.2f} ms", "info")

    vocab = cfg.vocab_size
    n_off = 6 if dry_run else 256
    scale = 0.05 if dry_run else 1.0
    warm = make_requests("sharegpt", 4 if dry_run else 32, math.inf, vocab_size=vocab, max_model_len=mml,
                         scale=scale, seed=3)
    for r in warm:
        r.output_len = min(r.output_len, 8 if dry_run else 64)
    wb = budget.sub(0.15)
    if wb.allows(5):
        perf["warmup"] = _serve(eng, warm, wb, rate_based=False)
        rec.save()
    off = budget.sub(0.55)
    reqs = make_requests("sharegpt", n_off, math.inf, vocab_size=vocab, max_model_len=mml,
                         scale=scale, seed=4)
    if off.allows(10 if not dry_run else 1):
        perf["offline_sharegpt"] = res = _serve(eng, reqs, off, rate_based=False)
        rec.save()
        rec.summarize(f"{spec.name} offline ShareGPT-like",
                      f"{res['output_tok_s']:.0f} out tok/s ({res['output_tok_s_excl_compile_steps']:.0f} "
                      f"w/o {res['compile_steps']} compile steps), {res['requests_added']} req"
                      f"{', cut at deadline' if res['aborted_at_deadline'] else ''}",
                      "info" if res["output_tokens"] > 0 else "FAIL")
    ab = budget.sub(0.25)
    if ab.allows(20 if not dry_run else 1):
        perf["async_ab"] = res = _async_ab(eng, reqs[: 8 if dry_run else 64], ab,
                                           max_tokens=8 if dry_run else 128)
        rec.save()
        if "async_over_sync" in res:  # both modes ran (the budget can cut it after one)
            rec.summarize(f"{spec.name} async / sync scheduling, {res['requests']} req",
                          f"{res['async_over_sync']:.3f}x output tok/s (async "
                          f"{res['tok_s']['async']:.0f}, sync {res['tok_s']['sync']:.0f}); "
                          f"outputs identical: {res['identical']}",
                          "info" if res["identical"] else "FAIL")
    tk = budget.sub(0.3)
    if tk.allows(20 if not dry_run else 1):
        # 32 requests x 64 tokens: at 64 x 128 the sixth run's share went to the untimed
        # warm-up's compiles (each batch bucket, both modes) and no run was timed.
        perf["top_k_ab"] = res = _top_k_ab(eng, reqs[: 8 if dry_run else 32], tk,
                                           max_tokens=8 if dry_run else 64)
        rec.save()
        if "chunked_over_one_stage" in res:
            rec.summarize(f"{spec.name} sampled, two-stage / one-stage top-k, "
                          f"{res['requests']} req",
                          f"{res['chunked_over_one_stage']:.3f}x output tok/s (two-stage "
                          f"{res['tok_s']['chunked']:.0f}, one-stage "
                          f"{res['tok_s']['one_stage']:.0f}); outputs identical: "
                          f"{res['identical']}", "info" if res["identical"] else "FAIL")
    rate = 8.0 if dry_run else 4.0
    online = make_requests("sharegpt", 8 if dry_run else 160, rate, vocab_size=vocab, max_model_len=mml,
                           scale=scale, seed=5)
    lat = budget.sub(1.0)
    if lat.allows(10 if not dry_run else 1):
        perf["online_sharegpt"] = res = _serve(eng, online, lat, rate_based=True)
        res["rate"] = rate
        rec.save()
        rec.summarize(f"{spec.name} TTFT / ITL @ {rate:g} req/s",
                      f"TTFT p50 {res['ttft_s']['p50'] * 1e3:.0f} p99 {res['ttft_s']['p99'] * 1e3:.0f} ms; "
                      f"ITL p50 {res['itl_ms']['p50']:.1f} p99 {res['itl_ms']['p99']:.1f} ms", "info")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run(out_dir: Path, budget: Budget, dry_run: bool, meta: dict) -> Recorder:
    from bench.gpu_suite.common import enable_compile_cache

    rec = Recorder(out_dir, "e2e", meta)
    on_gpu = meta["platform"] != "cpu"
    if on_gpu:
        enable_compile_cache()
    backend = "pallas" if on_gpu else "xla"
    rec.set("attention_backend", backend)
    # GPU_SUITE_E2E picks the parts and their order ("goldens,perf" by default): the demo fp32
    # goldens have passed on three GPU runs, so a short session may want the 8B timings alone.
    parts = [p.strip() for p in os.environ.get("GPU_SUITE_E2E", "goldens,perf").split(",") if p.strip()]
    if not parts or set(parts) - {"goldens", "perf"}:
        raise ValueError(f"GPU_SUITE_E2E: expected a comma list of goldens, perf; got {parts}")
    rec.set("parts", parts)
    for part in parts:
        if part == "goldens":
            later = "perf" in parts[parts.index(part) + 1:]
            correctness(rec, budget.sub(0.55) if later else budget, dry_run, backend)
            gc.collect()  # the golden models' engines and weights go before the 8B model arrives
        else:
            later = "goldens" in parts[parts.index(part) + 1:]
            performance(rec, budget.sub(0.7) if later else budget, dry_run, backend)
            gc.collect()
    fails = [r for r in rec.data["summary"] if r["verdict"] == "FAIL"]
    rec.finish("failed" if fails else "done")
    return rec
