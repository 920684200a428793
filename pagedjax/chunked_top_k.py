"""Top-k over a large vocabulary in two stages, for GPUs (`chunked_top_k`).

XLA's GPU backend has a dedicated top-k kernel for k <= 16 only; for a larger k it sorts
every row. The sampler's candidates (`sampler.TOP_CANDIDATES` = 128) and top logprobs
(`MAX_LOGPROBS` = 20) both ask for more than 16, so on an H200 a 256-row step sorted
256 x 128256 logits: 3.8 ms of a sampled step, against 0.3 ms for a row max and log-softmax
(`bench/results/nvidia_h200/gpu_suite/sampler_gpu_2026-11-28.json`, docs/v1-core.md).

Here each row is cut into chunks of `TOPK_CHUNK` logits and the 16 largest of each chunk are
taken first; the k largest of those few thousand per row come from a small sort. XLA takes a
chunk's 16 on its top-k kernel for chunks of 1024, and by sorting each chunk for chunks of
512 (compiled for H100), which the H200 ran faster (see `TOPK_CHUNK`).
The chunks are strided, not contiguous: chunk j holds tokens j, j + C, j + 2C, ... for C
chunks. A tokenizer numbers its tokens roughly by frequency, so a contiguous chunk of low ids
holds many of a row's likely tokens: on the demo model's real logits (`bench/
sampler_candidates.py`) contiguous chunks of 1024 left as few as 15 exact values in a row,
strided ones at least 225 (`sampler_candidates_chunked.json`).
That is the row's exact top-k unless one chunk holds more than 16 of them, so the function
also returns, per row, ``hidden``: the 16th value of the chunk where it is largest. A value
left out of the first stage is at most its chunk's 16th value, so every element greater than
``hidden`` is among the results, in order: result ``j`` is the row's exact j-th largest
wherever it is greater than ``hidden``. Callers use that to decide when the candidates
suffice (the sampler's ``known`` test) or fall back to `jax.lax.top_k` (top logprobs).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

# The largest k XLA's GPU top-k kernel takes without sorting the rows.
PER_CHUNK = 16


def _chunk_from_env() -> int:
    raw = os.environ.get("PAGEDJAX_TOPK_CHUNK", "512")
    try:
        chunk = int(raw)
    except ValueError:
        chunk = 0
    if chunk <= PER_CHUNK:
        raise ValueError(f"PAGEDJAX_TOPK_CHUNK: must be an integer above {PER_CHUNK} (logits "
                         f"per chunk of the two-stage top-k); got {raw!r}")
    return chunk


# Logits per chunk. On an H200 (`bench/sampler.py --platform gpu`, vocab 128256, top-128,
# `sampler_gpu_2026-11-30.json`) 512 was the fastest of 512-4096 at every batch: 0.65 ms at
# 64 rows and 1.81 ms at 256, against 1.09 / 3.52 ms for 1024 (the first default) and
# 1.30 / 2.62 ms for one-stage `lax.top_k`; at 1 row all sizes cost ~0.2-0.27 ms. Chunks of
# 1024 or more made the 256-row step slower than sorting. ``PAGEDJAX_TOPK_CHUNK`` sets
# another size.
TOPK_CHUNK = _chunk_from_env()


def chunked_top_k(x: jax.Array, k: int, chunk: int | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``values [B, k]`` (descending), ``ids [B, k]`` int32 and ``hidden [B]`` (see the
    module docstring) for ``x [B, V]``, ``k <= V``. Where one stage does (k within the
    kernel's 16, or chunks too few or too short) the results are
    `jax.lax.top_k`'s with ``hidden = -inf``."""
    chunk = TOPK_CHUNK if chunk is None else chunk
    b, v = x.shape
    c = -(-v // chunk)
    if k <= PER_CHUNK or c == 1 or v // c < PER_CHUNK or c * PER_CHUNK < k:
        vals, ids = jax.lax.top_k(x, min(k, v))
        return vals, ids.astype(jnp.int32), jnp.full((b,), -jnp.inf, x.dtype)
    # Chunk j, position i is token i * c + j. The -inf padding (ids >= v) comes last in each
    # chunk, which holds at least v // c >= 16 real values, and ties go to the lower
    # position: the first stage never keeps it. Ids are clamped into the vocabulary all the
    # same, should a GPU break ties otherwise.
    xp = jnp.pad(x, ((0, 0), (0, c * chunk - v)), constant_values=-jnp.inf)
    xs = xp.reshape(b, chunk, c).transpose(0, 2, 1).reshape(b * c, chunk)
    vals, idx = jax.lax.top_k(xs, PER_CHUNK)
    vals = vals.reshape(b, c, PER_CHUNK)
    idx = idx.reshape(b, c, PER_CHUNK) * c + jnp.arange(c, dtype=idx.dtype)[None, :, None]
    hidden = jnp.max(vals[:, :, PER_CHUNK - 1], axis=-1)
    # The second stage sorts by value, then id: ties in `jax.lax.top_k`'s order (lowest id
    # first), which the strided chunks' order alone would not give.
    neg, ids = jax.lax.sort((-vals.reshape(b, c * PER_CHUNK), idx.reshape(b, c * PER_CHUNK)),
                            dimension=1, num_keys=2)
    return -neg[:, :k], jnp.minimum(ids[:, :k], v - 1).astype(jnp.int32), hidden


def exact_top_k(x: jax.Array, k: int, chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k`'s values (ids as int32) from `chunked_top_k`, with one full top-k for
    the whole batch when some row's k-th value is not above its ``hidden`` (a chunk holds
    more than 16 of its top k). Rows whose hidden values are all ``-inf`` are exact in value;
    their ``-inf`` entries may name other ``-inf`` tokens than `jax.lax.top_k` would."""
    vals, ids, hidden = chunked_top_k(x, k, chunk)
    ok = jnp.all((vals[:, k - 1] > hidden) | (hidden == -jnp.inf))

    def flat(x):
        v, i = jax.lax.top_k(x, k)
        return v, i.astype(jnp.int32)

    return jax.lax.cond(ok, lambda x: (vals, ids), flat, x)
