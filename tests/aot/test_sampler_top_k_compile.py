"""On XLA's GPU backend `lax.top_k` with k > 16 sorts every row, so the sampler's candidates
(`TOP_CANDIDATES` = 128) sorted 128256 logits per row on the H200 (docs/v1-core.md). Compiled
for H100 here, the sampler a GPU runner uses (`chunked=True`, `pagedjax/chunked_top_k.py`)
takes each chunk's 16 largest first and sorts only those few thousand values per row, where
the one-stage sampler sorts the whole rows. How XLA takes a chunk's 16 depends on the chunk:
its top-16 kernel (``__gpu$TopK``) for chunks of 1024, a sort of each 512-logit chunk for
512, which the sixth H200 run measured faster (1.81 against 3.52 ms at 256 rows)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from pagedjax.aot.target import compile_only_devices
from pagedjax.chunked_top_k import PER_CHUNK, TOPK_CHUNK, chunked_top_k
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, sample
from pagedjax.sampling_params import SamplingParams

B, V = 64, 128256
# The first stage's values per row: 16 from each chunk (251 chunks of 512 since stop 64).
FIRST_STAGE = -(-V // TOPK_CHUNK) * PER_CHUNK


def _sorted_widths(hlo: str, rows: int = B) -> list[int]:
    """Row widths of every f32 sort of ``rows`` rows in a compiled module."""
    return [int(m) for m in re.findall(rf"\(f32\[{rows},(\d+)\]\{{1,0\}}[^()]*\) sort\(", hlo)]


def _first_stage_on_chunks(hlo: str) -> bool:
    """The chunks' 16 largest come from the top-k kernel or from sorting each chunk alone."""
    chunks = -(-V // TOPK_CHUNK)
    return "__gpu$TopK" in hlo or _sorted_widths(hlo, B * chunks) == [TOPK_CHUNK]


def _compile(f, *args, **kw) -> str:
    dev = compile_only_devices("h100")[0]
    sh = SingleDeviceSharding(dev)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype, sharding=sh), args)
    with jax.default_device(dev):
        return jax.jit(f, static_argnames=tuple(kw)).lower(*abstract, **kw).compile().as_text()


@pytest.mark.parametrize("chunked", [False, True])
def test_gpu_sampler_candidates_sort_no_whole_row(chunked):
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02)
    meta = SamplingMetadata.from_params([(p, SeqSamplingState([1], [2]))] * B, B, V)
    logits = jnp.zeros((B, V), jnp.float32)
    # No top logprobs: the candidates are the only top-k (`exact_top_k` falls back to one
    # whole-row top-k, in a conditional, when a chunk hides part of a row's top 20).
    hlo = _compile(lambda x, m, chunked: sample(x, m, num_logprobs=0, chunked=chunked),
                   logits, meta, chunked=chunked)
    widths = _sorted_widths(hlo)
    if chunked:
        assert _first_stage_on_chunks(hlo)
        assert widths and max(widths) <= FIRST_STAGE < V // 16, widths
    else:
        assert V in widths, widths


def test_chunked_top_k_alone_sorts_no_whole_row():
    hlo = _compile(lambda x: chunked_top_k(x, 128), jnp.zeros((B, V), jnp.float32))
    assert _first_stage_on_chunks(hlo) and _sorted_widths(hlo) == [FIRST_STAGE]
