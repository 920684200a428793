"""Which KV quantization schemes could meet issue 20's quality target (<= 1 % greedy-token
disagreement with the full-precision engine)? A model-level study, not an engine run.

The demo model (fp32) runs each sequence at once with K and V rounded through a scheme
before dense causal attention ("fake quantization": the values the kernels would read, with
none of the paged machinery). The sequences are the chat-formatted bench prompts plus the
fp32 engine's 64 greedy tokens; the measure is teacher-forced top-1 disagreement with the
unrounded model over the generated positions, also counted only where the fp32 model's top-2
margin exceeds 0.05 nats (elsewhere any perturbation, a bf16 cache's included, flips it), and
mean |delta logprob| of the reference token.

Schemes per tensor: ``ch`` (what pagedjax builds: a static scale per (layer, KV head,
channel), calibrated as the engine does, headroom 1.2; ``ch@M``: headroom M instead),
``head`` (static per head), ``tok`` (a dynamic scale per token and head: would need storage
per token), ``asym`` (static per channel with a zero point from calibrated min/max: free in
the kernels, since K's offset adds a constant per query row that softmax cancels and V's adds
a constant to the output), ``ctok`` (the static channel scales times a dynamic per-token
factor that fits each token's channel-normalised vector exactly: the channel scales flatten
the outlier channels, the token factor removes saturation and calibration's headroom; needs
one scale per token and head), ``rtok`` (a Hadamard rotation of the head dim before a
per-token scale, QuaRot-style: spreads outlier channels; the rotation folds into q and the
output), ``rch`` (the rotation with static per-channel scales calibrated on rotated values),
``g16`` (a dynamic scale per token and 16 channels: a bound, too costly for the kernels), and
plain ``bfloat16`` / ``float16`` casts as the floor a 16-bit cache sets.

    .venv/bin/python bench/kv_quant_schemes.py   # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAIRS = ["bfloat16:bfloat16", "float16:float16", "ch:ch", "ch:none", "none:ch", "ch@1.0:ch@1.0",
         "ch@2.0:ch@2.0", "head:head", "tok:tok", "ch:tok", "asym:asym", "rch:rch", "rtok:rtok",
         "ctok:ctok", "ctok:none", "none:ctok", "g16:g16"]
NEAR_TIE = 0.05  # nats


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.offline_throughput import PROMPTS
    from models.decoder import DecoderLM
    from models.demo import ensure_demo_model
    from models.gguf_loader import load_gguf
    from models.tokenizer import load_tokenizer
    from pagedjax import LLM, SamplingParams
    from pagedjax.worker.kv_calibration import CalibrationAttention, calibration_ids

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="int8,float8_e4m3fn")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="KMODE:VMODE,...")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/kv_quant_schemes.json"))
    args = ap.parse_args()

    path = ensure_demo_model()
    tok = load_tokenizer(path)
    cfg, params = load_gguf(path)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    had = np.ones((1, 1))
    while had.shape[0] < D:  # Sylvester's construction; orthonormal after the scaling
        had = np.block([[had, had], [had, -had]])
    if had.shape[0] != D:
        raise SystemExit(f"head dim {D} is not a power of two: no Hadamard rotation")
    HAD = jnp.asarray(had / np.sqrt(D), jnp.float32)

    @dataclasses.dataclass(frozen=True)
    class MinMax:
        """Records max and -min per (layer, head, channel) of K, V and their rotations in the
        'cache'."""

        def __call__(self, q, k, v, cache, layer, meta, *, scale=None, window=0, softcap=None):
            kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
            both = [kf, vf, kf @ HAD, vf @ HAD]
            hi = jnp.stack([x.max(0) for x in both])
            nlo = -jnp.stack([x.min(0) for x in both])
            cache = cache.at[layer, 0].max(hi).at[layer, 1].max(nlo)
            out, _ = CalibrationAttention()(q, k, v, jnp.zeros((L, 2, H, D)), layer, meta,
                                            scale=scale, window=window, softcap=softcap)
            return out, cache

    cal = jnp.asarray(calibration_ids(tok, cfg.vocab_size, 512))
    mm = np.asarray(jax.jit(lambda p, ids: DecoderLM(cfg, MinMax()).apply(
        {"params": p}, ids, jnp.arange(ids.shape[0]), jnp.full((L, 2, 4, H, D), -1e30), None,
        logits_indices=jnp.zeros((1,), jnp.int32))[1])(params, cal))
    hi, lo = mm[:, 0], -mm[:, 1]  # [L, 4 (K, V, rotated K, rotated V), H, D]
    stats = jnp.asarray(np.stack([np.maximum(hi, -lo), hi, lo], 1))  # [L, 3, 2, H, D]

    llm = LLM.from_params(cfg, params, tok, num_gpu_blocks=256, block_size=16, max_model_len=512)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0, max_tokens=args.tokens), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    starts = [len(o.prompt_token_ids) for o in outs]
    del llm

    def fake_quant(x, mode, st, dt, rot_st):
        """``x [T, H, D]`` as the kernels would read it; ``st [3, H, D]``: amax, max, min
        (``rot_st``: of the rotated values)."""
        x = x.astype(jnp.float32)
        if mode in ("rch", "rtok"):  # rotate, quantize, rotate back (H is symmetric)
            return fake_quant(x @ HAD, mode[1:], rot_st, dt, None) @ HAD
        if mode == "none":
            return x
        if mode in ("bfloat16", "float16"):
            return x.astype(mode).astype(jnp.float32)
        qm = 127.0 if dt == "int8" else float(jnp.finfo(dt).max)
        margin = 1.2 if dt == "int8" else 2.0  # the engine's headroom
        if mode.startswith("ch@"):
            mode, margin = "ch", float(mode[3:])
        zero = 0.0
        if mode == "ch":
            s = st[0] * margin / qm
        elif mode == "head":
            s = jnp.broadcast_to(st[0].max(-1, keepdims=True), st[0].shape) * margin / qm
        elif mode == "tok":
            s = jnp.abs(x).max(-1, keepdims=True) / qm
        elif mode == "ctok":
            c = jnp.where(st[0] > 0, st[0], 1.0)
            s = c * jnp.abs(x / c).max(-1, keepdims=True) / qm
        elif mode == "g16":
            g = x.reshape(*x.shape[:-1], -1, 16)
            s = jnp.repeat(jnp.abs(g).max(-1), 16, axis=-1) / qm
        elif mode == "asym":
            zero = (st[1] + st[2]) / 2
            s = (st[1] - st[2]) / 2 * margin / qm
        else:
            raise ValueError(f"--pairs: unknown mode {mode!r}")
        s = jnp.where(s > 0, s, 1.0)
        y = (x - zero) / s
        if dt == "int8":
            y = jnp.clip(jnp.round(y), -qm, qm)
        else:
            y = jnp.clip(y, -qm, qm).astype(dt).astype(jnp.float32)
        return y * s + zero

    @dataclasses.dataclass(frozen=True)
    class FakeQuantAttention:
        kmode: str
        vmode: str
        dt: str

        def __call__(self, q, k, v, st, layer, meta, *, scale=None, window=0, softcap=None):
            k = fake_quant(k, self.kmode, st[layer, :, 0], self.dt, st[layer, :, 2])
            v = fake_quant(v, self.vmode, st[layer, :, 1], self.dt, st[layer, :, 3])
            out, _ = CalibrationAttention()(q, k, v, jnp.zeros((L, 2, H, D)), layer, meta,
                                            scale=scale, window=window, softcap=softcap)
            return out, st

    def score(kmode, vmode, dt):
        m = DecoderLM(cfg, FakeQuantAttention(kmode, vmode, dt))
        f = jax.jit(lambda p, ids: jax.nn.log_softmax(m.apply(
            {"params": p}, ids, jnp.arange(ids.shape[0]), stats, None,
            logits_indices=jnp.arange(ids.shape[0]))[0], -1))
        tops, lps, margins = [], [], []
        for s, st in zip(seqs, starts, strict=True):
            lg = np.asarray(f(params, jnp.asarray(s)))[st - 1:len(s) - 1]
            tops.append(lg.argmax(-1))
            srt = np.sort(lg, -1)
            margins.append(srt[:, -1] - srt[:, -2])
            lps.append(lg[np.arange(len(lg)), s[st:]])
        return np.concatenate(tops), np.concatenate(lps), np.concatenate(margins)

    load0 = os.getloadavg()[0]
    t0 = time.time()
    base, base_lp, margin = score("none", "none", "int8")
    clear = margin > NEAR_TIE
    rows = []
    for dt in args.dtypes.split(","):
        for pair in args.pairs.split(","):
            km, vm = pair.split(":")
            if dt != args.dtypes.split(",")[0] and km in ("bfloat16", "float16"):
                continue  # a cast does not depend on the quantized dtype
            t, lp, _ = score(km, vm, dt)
            row = {"dtype": dt if km not in ("bfloat16", "float16") else km, "k": km, "v": vm,
                   "top1_disagreement": float(np.mean(t != base)),
                   "top1_disagreement_clear": float(np.mean((t != base)[clear])),
                   "mean_abs_dlogprob": float(np.mean(np.abs(lp - base_lp)))}
            rows.append(row)
            print(f"{row['dtype']:14s} K={km:8s} V={vm:8s} disagree "
                  f"{row['top1_disagreement'] * 100:5.2f} % (clear positions "
                  f"{row['top1_disagreement_clear'] * 100:5.2f} %)  |dlp| "
                  f"{row['mean_abs_dlogprob']:.4f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res = {"what": "bench/kv_quant_schemes.py (see its docstring)", "commit": commit,
           "model": "SmolLM2-135M-Instruct Q4_1 GGUF dequantized to fp32",
           "positions": int(len(base)), "near_tie_fraction": float(np.mean(~clear)),
           "near_tie_nats": NEAR_TIE, "rows": rows, "seconds": round(time.time() - t0, 1),
           "machine": {"cpu": platform.machine(), "cpu_count": os.cpu_count(),
                       "load_avg_1m_at_start": load0, "load_avg_1m_at_end": os.getloadavg()[0]},
           "versions": {"jax": jax.__version__, "python": platform.python_version()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("->", args.out)


if __name__ == "__main__":
    main()
