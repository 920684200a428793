"""Static scales of a quantized KV cache, calibrated once when the engine starts.

The model runs one calibration prompt (`CALIBRATION_TEXT`, or fixed pseudo-random ids for an
engine whose tokenizer cannot encode) in full precision with `CalibrationAttention` in place of the
paged attention: dense causal attention over the prompt (windows and soft-caps as the
model's), which records each layer's largest |K| and |V| per (KV head, channel) instead of
writing a cache. `pallas_kernels.kv_quant.scales_from_amax` turns those maxima into the scales the
kernels read (with headroom: values larger than calibration saw saturate).

vLLM's FP8 cache defaults to a scale of 1.0 unless calibrated (`calculate_kv_scales`); int8
has no such default (a scale of 1 would round every value below 0.5 to zero), so pagedjax
calibrates for every quantized dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Prose, dialogue, code, numbers and lists: a spread of token kinds, written for this project.
CALIBRATION_TEXT = """\
The lighthouse keeper climbed the spiral stairs at dusk, counting the one hundred and twelve
steps as he always did. Below, the harbour filled with fishing boats returning before the storm.
"Will the ferry run tomorrow?" asked the girl at the window. "Only if the wind drops below
forty knots," he said, and wrote the reading in the log: 19:42, pressure 998 hPa, falling.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Shopping list: 2 kg flour, 12 eggs, olive oil (500 ml), basil, 3 lemons, sea salt.
In 1687 Newton published the Principia; its three laws of motion relate force, mass and
acceleration (F = m * a). Photosynthesis converts carbon dioxide and water into glucose and
oxygen using light energy absorbed by chlorophyll. SELECT name, COUNT(*) FROM orders
WHERE total > 100 GROUP BY name ORDER BY 2 DESC; -- the top customers this quarter.
Question: what is 17 times 23? Answer: 391. Translate "good morning" into French: bonjour.
"""
MAX_CALIBRATION_TOKENS = 512


def calibration_ids(tokenizer, vocab_size: int, max_len: int) -> list[int]:
    """The calibration prompt's token ids (chat-formatted when the tokenizer has a
    template, since served prompts are), at most `max_len` and 512 long."""
    n = min(max_len, MAX_CALIBRATION_TOKENS)
    if tokenizer is None or not callable(tokenizer):  # none, or one that only decodes
        rng = np.random.default_rng(0)
        return [int(t) for t in rng.integers(0, vocab_size, n)]
    ids = None
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": CALIBRATION_TEXT}], tokenize=True,
                add_generation_prompt=True)
            ids = list(getattr(ids, "input_ids", ids))
        except Exception:  # a template that wants other roles or fields: plain text
            ids = None
    if ids is None:
        ids = list(tokenizer(CALIBRATION_TEXT).input_ids)
    return [int(t) for t in ids if 0 <= int(t) < vocab_size][:n]


@dataclasses.dataclass(frozen=True)
class CalibrationAttention:
    """An `AttentionFn` whose "cache" is the running max |K| and |V| per (layer, KV head,
    channel), ``[num_layers, 2, Hkv, D]``; attention is dense and causal over one sequence."""

    def __call__(self, q, k, v, kv_cache, layer, meta, *, scale: float | None = None,
                 window=0, softcap: float | None = None):
        del meta
        t, hq, d = q.shape
        hkv = k.shape[1]
        amax = jnp.stack([jnp.abs(k.astype(jnp.float32)).max(axis=0),
                          jnp.abs(v.astype(jnp.float32)).max(axis=0)])
        kv_cache = kv_cache.at[layer].max(amax)
        scale = d ** -0.5 if scale is None else scale
        kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=1)
        vf = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) * scale
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        pos = jnp.arange(t)
        seen = pos[None, :] <= pos[:, None]
        w = jnp.asarray(window, jnp.int32)
        seen &= (w <= 0) | (pos[None, :] > pos[:, None] - w)
        logits = jnp.where(seen[None], logits, -1e30)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, axis=-1), vf)
        return out.astype(q.dtype), kv_cache


def calibrate_amax(model, params, num_layers: int, num_kv_heads: int, head_dim: int,
                   token_ids: list[int]) -> np.ndarray:
    """Max |K| and |V| per (layer, KV head, channel) over the prompt:
    ``[num_layers, 2, Hkv, D]``. ``model``: a `DecoderLM` built with `CalibrationAttention`."""
    ids = jnp.asarray(token_ids, jnp.int32)
    init = jnp.zeros((num_layers, 2, num_kv_heads, head_dim), jnp.float32)

    @jax.jit
    def run(params, ids, init):
        _, amax = model.apply({"params": params}, ids, jnp.arange(ids.shape[0]), init, None,
                              logits_indices=jnp.zeros((1,), jnp.int32))
        return amax

    return np.asarray(jax.device_get(run(params, ids, init)))
