"""CPU throughput of the reference generator (contiguous cache) and model compile time.

The figures the foundation issue asks for, kept for later comparison with the paged engine:
tokens/s at batch 1 and 16 on the demo model (greedy, fixed output length), and the time to
compile the scanned 30-layer model for a prefill and a decode shape.

    python bench/reference_throughput.py [--out bench/results/cpu/reference_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from models.decoder import ContiguousMeta, init_contiguous_cache
from models.demo import ensure_demo_model
from models.gguf_loader import load_gguf
from pagedjax.reference import ReferenceGenerator


def compile_seconds(gen: ReferenceGenerator, batch: int, seq: int, max_len: int) -> float:
    cache = init_contiguous_cache(gen.config, batch, max_len, gen.dtype)
    ids = np.zeros((batch, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    t0 = time.perf_counter()
    jax.jit(lambda p, c, i, q: gen.model.apply({"params": p}, i, q, c, ContiguousMeta(q))).lower(
        gen.params, cache, ids, pos).compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cpu/reference_throughput.json")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    config, params = load_gguf(ensure_demo_model())
    gen = ReferenceGenerator(config, params)
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "machine": platform.processor() or platform.machine(), "model": "SmolLM2-135M-Instruct fp32",
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "compile_s": {"prefill_1x64": compile_seconds(gen, 1, 64, 128),
                            "decode_16x1": compile_seconds(gen, 16, 1, 128)},
              "throughput": {}}
    for batch in (1, 16):
        prompts = [list(rng.integers(3, config.vocab_size, args.prompt_len)) for _ in range(batch)]
        gen.generate(prompts, 4, ignore_eos=True)  # compile
        t0 = time.perf_counter()
        out = gen.generate(prompts, args.new_tokens, ignore_eos=True)
        dt = time.perf_counter() - t0
        toks = sum(len(o) for o in out)
        result["throughput"][f"batch{batch}"] = {"seconds": dt, "tokens": toks, "tokens_per_s": toks / dt}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
