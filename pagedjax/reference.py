"""The reference generator: the oracle the paged engine is checked against.

Deliberately simple: every sequence owns one contiguous KV region of `max_len` slots
(`models.decoder.ContiguousAttention`), prompts are right-padded into one batch, one jitted
prefill, then one jitted decode step per token driven from Python. No paging, no sharing,
no scheduling: if the paged engine disagrees with this, the engine is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decoder import ContiguousAttention, ContiguousMeta, DecoderLM, init_contiguous_cache


def _bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two so repeated calls reuse compiled shapes."""
    b = minimum
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass(frozen=True)
class RefSampling:
    """Sampling for the oracle: greedy when temperature == 0, else seeded categorical."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0


def _sample_rows(logits: jax.Array, keys: jax.Array, temperature: float, top_k: int,
                 top_p: float) -> jax.Array:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        cutoff = jnp.min(jnp.where(cum < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys, logits).astype(jnp.int32)


class ReferenceGenerator:
    """Batched generation with a contiguous KV cache (greedy and seeded sampling)."""

    def __init__(self, config: ModelConfig, params: dict, dtype=jnp.float32):
        self.config = config
        self.params = params
        self.dtype = dtype
        self.model = DecoderLM(config, ContiguousAttention(), dtype)

    @partial(jax.jit, static_argnums=0, donate_argnums=2)
    def _forward(self, params, cache, ids, pos, logits_idx):
        return self.model.apply({"params": params}, ids, pos, cache, ContiguousMeta(pos),
                                logits_indices=logits_idx)

    def prompt_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """fp32 logits at every position of one prompt (for comparisons with HF)."""
        n = len(token_ids)
        s = _bucket(n)
        ids = np.zeros((1, s), np.int32)
        ids[0, :n] = token_ids
        pos = np.where(np.arange(s) < n, np.arange(s), -1)[None].astype(np.int32)
        cache = init_contiguous_cache(self.config, 1, s, self.dtype)
        logits, _ = self._forward(self.params, cache, ids, pos, jnp.arange(n, dtype=jnp.int32))
        return np.asarray(logits)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
                 sampling: RefSampling | Sequence[RefSampling] = RefSampling(),
                 eos_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> list[list[int]]:
        """Generated token ids per prompt (EOS included when it ends a sequence)."""
        b = len(prompts)
        if b == 0:
            return []
        max_toks = [max_tokens] * b if isinstance(max_tokens, int) else list(max_tokens)
        samplings = [sampling] * b if isinstance(sampling, RefSampling) else list(sampling)
        if len({(s.temperature, s.top_k, s.top_p) for s in samplings}) != 1:
            raise ValueError("the reference generator samples a batch with one temperature/top-k/top-p")
        samp = samplings[0]
        lens = np.array([len(p) for p in prompts])
        if lens.min() < 1:
            raise ValueError("empty prompt")
        s = _bucket(int(lens.max()))
        max_len = _bucket(int(lens.max()) + max(max_toks))
        bb = _bucket(b, 1)
        ids = np.zeros((bb, s), np.int32)
        pos = np.full((bb, s), -1, np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
            pos[i, : len(p)] = np.arange(len(p))
        cache = init_contiguous_cache(self.config, bb, max_len, self.dtype)
        last = np.zeros(bb, np.int32)
        last[:b] = np.arange(b) * s + lens - 1
        logits, cache = self._forward(self.params, cache, ids, pos, jnp.asarray(last))
        base_keys = [jax.random.key(smp.seed) for smp in samplings] + [jax.random.key(0)] * (bb - b)
        base_keys = jnp.stack(base_keys)

        eos = set(eos_token_ids)
        outputs: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(bb, bool)
        done[b:] = True
        cur_pos = np.zeros(bb, np.int32)
        cur_pos[:b] = lens
        step = 0
        while True:
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, step)
            tokens = np.asarray(_sample_rows(logits, keys, samp.temperature, samp.top_k, samp.top_p))
            for i in range(b):
                if done[i]:
                    continue
                outputs[i].append(int(tokens[i]))
                if len(outputs[i]) >= max_toks[i] or (not ignore_eos and int(tokens[i]) in eos):
                    done[i] = True
            if done.all():
                return outputs
            step += 1
            dpos = np.where(done, -1, cur_pos)[:, None].astype(np.int32)
            logits, cache = self._forward(self.params, cache, tokens[:, None].astype(np.int32), dpos,
                                          jnp.arange(bb, dtype=jnp.int32))
            cur_pos += 1
