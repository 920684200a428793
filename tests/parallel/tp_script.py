"""Runs in a subprocess with 8 forced host devices (see test_tensor_parallel.py).

`python -m tests.parallel.tp_script MODE OUT.json` runs one scenario at several TP sizes and
writes what the tests assert on: greedy tokens, top-k logprobs, one step's full logits,
parameter bytes from the shardings, preemption and prefix-cache counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.parallel.hlo import count_collectives
from pagedjax.parallel.mesh import sharded_param_bytes
from pagedjax.worker.step_inputs import build_step_inputs
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors


class NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def tiny_model(heads: int = 8, kv_heads: int = 2) -> tuple[ModelConfig, dict]:
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIG, "num_attention_heads": heads,
                               "num_key_value_heads": kv_heads, "head_dim": 8})
    return cfg, assemble_params(cfg, random_hf_tensors(cfg, seed=3).get)


def prompts_for(vocab: int, n: int = 5) -> list[list[int]]:
    """Prompts sharing a 16-token prefix (prefix caching hits) and of different lengths."""
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(3, vocab, 16)]
    return [prefix + [int(t) for t in rng.integers(3, vocab, k)] for k in (1, 9, 20, 4, 30)[:n]]


def one_step_logits(llm: LLM, prompt: list[int]) -> np.ndarray:
    """Full logits of one prefill step run directly on the runner (blocks 0.. overwritten)."""
    runner = llm.engine.runner
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    seq = ScheduledSeq(0, "logits", prompt, 0, blocks, True)
    inputs = build_step_inputs([seq], runner.block_size, runner.max_blocks_per_seq,
                               num_groups=runner.num_kv_groups)
    return np.asarray(jax.device_get(runner.execute(inputs)))[0]


def decode_collectives(llm: LLM) -> dict:
    """Collectives in the compiled decode step, per layer and outside the layer scan."""
    runner = llm.engine.runner
    seq = ScheduledSeq(0, "hlo", [5], 3, [0], True)
    inputs = build_step_inputs([seq], runner.block_size, runner.max_blocks_per_seq,
                               num_groups=runner.num_kv_groups)
    hlo = runner._step.lower(runner, runner.params, runner.k_cache, runner.v_cache,
                             inputs.input_ids, inputs.positions, runner.step_meta(inputs.meta),
                             inputs.logits_indices).compile().as_text()
    return count_collectives(hlo)


def expert_spec(llm: LLM) -> str:
    """Sharding of the first expert weight ("" for dense models or one device)."""
    layers = llm.engine.runner.params.get("layers", {})
    w = layers.get("expert_gate")
    return str(w.sharding.spec) if w is not None and hasattr(w.sharding, "spec") else ""


def run(cfg: ModelConfig, params: dict, tp: int, prompts, max_tokens: int, **kw) -> dict:
    llm = LLM.from_params(cfg, params, NoTokenizer(), tensor_parallel_size=tp, block_size=8,
                          max_num_seqs=4, max_num_batched_tokens=64, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                       logprobs=3))
    stats = llm.engine.get_stats()
    total, per_device = sharded_param_bytes(llm.engine.runner.params)
    llm.engine.block_manager.check_invariants()
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[sorted(d.values()) for d in o.outputs[0].logprobs] for o in outs],
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "preemptions": stats.num_preemptions_total,
        "free_blocks_ok": llm.engine.block_manager.get_num_free_gpu_blocks() == stats.num_gpu_blocks,
        "logits": one_step_logits(llm, prompts[0]).tolist(),
        "param_bytes": [total, per_device],
        "cache_spec": str(llm.engine.runner.k_cache.sharding.spec) if tp > 1 else "",
        "cache_dtype": str(llm.engine.runner.k_cache.dtype),
        "cache_heads": llm.engine.runner.k_cache.shape[1],
        "collectives": decode_collectives(llm) if tp == 2 else None,
        "expert_spec": expert_spec(llm),
    }


def main(mode: str, out_path: str) -> None:
    results: dict[str, dict] = {}
    common = dict(enable_prefix_caching=True)
    if mode == "tiny":
        cfg, params = tiny_model()
        prompts = prompts_for(cfg.vocab_size)
        # 12 blocks of 8 for 5 sequences of up to 62 tokens: preemption is certain. TP=2
        # preempts by swapping (host pool of per-head shards), TP=1/4 by recomputing.
        results["tp1"] = run(cfg, params, 1, prompts, 16, num_gpu_blocks=12, **common)
        results["tp2"] = run(cfg, params, 2, prompts, 16, num_gpu_blocks=12,
                             preemption_mode="swap", **common)
        results["tp4"] = run(cfg, params, 4, prompts, 16, num_gpu_blocks=12, **common)
        # 8 > 2 KV heads: each KV head replicated 4 times. Greedy, so the first tokens of a
        # shorter run must equal TP=1's.
        results["tp8"] = run(cfg, params, 8, prompts[:2], 6, num_gpu_blocks=32)
        # An int8 KV cache: bytes and per-(head, channel) scales split by head with the cache.
        results["tp1_int8"] = run(cfg, params, 1, prompts, 16, num_gpu_blocks=12,
                                  kv_cache_dtype="int8", **common)
        results["tp2_int8"] = run(cfg, params, 2, prompts, 16, num_gpu_blocks=12,
                                  preemption_mode="swap", kv_cache_dtype="int8", **common)
        # int8 weights (packed per channel): split like kernels where their scales split,
        # replicated where not; TP=1 multiplies with the native kernel, TP=2 through XLA.
        results["tp1_q8w"] = run(cfg, params, 1, prompts, 16, num_gpu_blocks=12,
                                 quantization="int8", **common)
        results["tp2_q8w"] = run(cfg, params, 2, prompts, 16, num_gpu_blocks=12,
                                 quantization="int8", **common)
        # The unrolled layer loop (the GPU default at any TP): q/k/v and gate/up fused per
        # shard. TP=4 > 2 KV heads replicates KV columns inside the fused matrix.
        results["tp2_unrolled"] = run(cfg, params, 2, prompts, 16, num_gpu_blocks=12,
                                      preemption_mode="swap", layer_loop="unrolled", **common)
        results["tp4_unrolled"] = run(cfg, params, 4, prompts, 16, num_gpu_blocks=12,
                                      layer_loop="unrolled", **common)
        # The Pallas kernels (interpret mode on CPU) inside shard_map.
        results["tp2_pallas"] = run(cfg, params, 2, prompts[:2], 6, num_gpu_blocks=32,
                                    attention_backend="pallas", **common)
    elif mode == "demo":
        from models.demo import ensure_demo_model
        from models.gguf_loader import load_gguf

        cfg, params = load_gguf(ensure_demo_model())
        prompts = prompts_for(cfg.vocab_size, 3)
        for tp in (1, 3):
            results[f"tp{tp}"] = run(cfg, params, tp, prompts, 12, num_gpu_blocks=8, **common)
    elif mode == "families":
        import tempfile

        from models.loader import load_model
        from tests.model.test_families import write_family

        # Routed and shared experts split by width, q/k norms, QKV biases (replicated with
        # their KV heads at TP=4 > 2 KV heads), Gemma 2's soft-caps, windows, sandwich norms.
        for name, sizes in (("qwen2_moe", (1, 2, 4)), ("qwen3_moe", (1, 2)), ("gemma2", (1, 2))):
            with tempfile.TemporaryDirectory() as tmp:
                write_family(name, Path(tmp))
                cfg, params, _ = load_model(tmp, dtype="float32")
            prompts = prompts_for(cfg.vocab_size, 3)
            for tp in sizes:
                results[f"{name}-tp{tp}"] = run(cfg, params, tp, prompts, 12, num_gpu_blocks=12,
                                                **common)
            # Expert parallelism: whole experts per device (qwen2_moe: 4 experts, qwen3_moe: 6).
            for tp in {"qwen2_moe": (2, 4), "qwen3_moe": (2,)}.get(name, ()):
                results[f"{name}-ep{tp}"] = run(cfg, params, tp, prompts, 12, num_gpu_blocks=12,
                                                enable_expert_parallel=True, **common)
    else:
        raise SystemExit(f"unknown mode {mode}")
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
