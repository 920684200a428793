"""Build the benchmark engine (demo model or seeded random weights) and swap in a KV policy.

The engine builds a paged ``BlockManager`` + ``Scheduler``; we replace both with the
policy's pair from :mod:`pagedjax.core.policies` before any request is added. The model
runner and its KV tensors are untouched, so every policy runs the same jitted kernels.
"""

from __future__ import annotations

import functools

from pagedjax.core import SchedulerConfig
from pagedjax.core.policies import make_kv_manager, make_scheduler


@functools.lru_cache(maxsize=1)
def demo_model():
    """(config, params, tokenizer) of SmolLM2-135M (cached locally)."""
    from models.demo import ensure_demo_model
    from models.gguf_loader import load_gguf
    from models.tokenizer import load_tokenizer

    path = ensure_demo_model()
    config, params = load_gguf(path)
    return config, params, load_tokenizer(path)


# Random-weight stand-ins (bench/gpu_suite/seeded.py): the paper's metrics depend on lengths,
# memory and step time, not on what the model says, so a GPU run needs no checkpoint.
RANDOM_MODELS = {"13b-random": "llama_13b", "tiny-random": "tiny"}
MODELS = ("demo", *RANDOM_MODELS)


def model_source(model: str = "demo", dtype: str | None = None):
    """(config, params, tokenizer): the demo GGUF, or seeded-random weights drawn on the device
    (``13b-random``: Llama-2-13B shapes, the paper's OPT-13B stand-in; bf16 unless ``dtype``)."""
    if model == "demo":
        config, params, tok = demo_model()
        if dtype is not None:
            import jax
            import jax.numpy as jnp

            params = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), params)
        return config, params, tok
    if model not in RANDOM_MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
    import jax.numpy as jnp

    from bench.gpu_suite.seeded import SPECS, NoTokenizer, device_random_params

    spec = SPECS[RANDOM_MODELS[model]]
    params = device_random_params(spec.config, spec.seed, jnp.dtype(dtype or "bfloat16"))
    return spec.config, params, NoTokenizer()


def build_llm(*, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
              max_num_batched_tokens: int, preemption_mode: str = "recompute", swap_space_gb: float = 0.25,
              model: str = "demo", dtype: str | None = None):
    from pagedjax import LLM

    config, params, tok = model_source(model, dtype)
    # The paper's systems: no chunked prefill (vLLM 0.1 had none) for any policy, and prefix
    # caching only where `set_policy` asks for it, whatever this engine's defaults are now.
    return LLM.from_params(config, params, tok, num_gpu_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           preemption_mode=preemption_mode, swap_space_gb=swap_space_gb,
                           enable_chunked_prefill=False, enable_prefix_caching=False)


def set_policy(engine, policy: str, *, prefix_caching: bool = False,
               preemption_mode: str | None = None, max_model_len: int | None = None) -> None:
    """Replace the engine's block manager and scheduler (idle engine only).

    ``prefix_caching`` (paged only) turns on automatic prefix caching; ``preemption_mode``
    overrides the engine's ("swap" uses the engine's CPU swap pool); ``max_model_len`` (at
    most the engine's) is the context the scheduler admits and the Orca baselines reserve.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("set_policy on a busy engine")
    old = engine.scheduler.config
    mml = max_model_len or engine.max_model_len
    if mml > engine.max_model_len:
        raise ValueError(f"max_model_len {mml} exceeds the engine's {engine.max_model_len}")
    cfg = SchedulerConfig(max_model_len=mml, max_num_seqs=old.max_num_seqs,
                          max_num_batched_tokens=old.max_num_batched_tokens,
                          enable_chunked_prefill=old.enable_chunked_prefill,
                          preemption_mode=preemption_mode or engine.engine_config.preemption_mode,
                          policy=old.policy)
    bm0 = engine.block_manager
    bm = make_kv_manager(policy, bm0.num_gpu_blocks, bm0.num_cpu_blocks, bm0.block_size,
                         max_model_len=mml, enable_prefix_caching=prefix_caching)
    engine.block_manager = bm
    engine.scheduler = make_scheduler(policy, cfg, bm)
