"""Run by `test_chunked_top_k_sharded.py` with 2 forced host devices: `sample(chunked=True)`
on logits sharded over the vocabulary (as a TP runner's LM head may leave them) against the
one-stage sampler on the same array."""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pagedjax.chunked_top_k as ctk
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, sample
from pagedjax.sampling_params import SamplingParams


def main() -> None:
    assert jax.device_count() == 2
    ctk.TOPK_CHUNK = 64
    b, v = 8, 4096
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(b, v)) * 4).astype(np.float32)
    x[1, ctk_ids(v, 64, 3, 40)] += 30  # one row crowds a chunk: the fallbacks run too
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    logits = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "tp")))
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=[-1, 50][i % 2], seed=i,
                             logprobs=20) for i in range(b)]
    meta = SamplingMetadata.from_params(
        [(p, SeqSamplingState([1], [2], i, 0)) for i, p in enumerate(params)], b, v)
    for s in range(5):
        m = meta.replace(seed=meta.seed + s)
        one = sample(logits, m, num_logprobs=20)
        two = sample(logits, m, num_logprobs=20, chunked=True)
        for a, c in zip(one[:5], two[:5]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    print("ok")


def ctk_ids(v: int, chunk: int, j: int, n: int) -> np.ndarray:
    c = -(-v // chunk)
    return j + c * np.arange(n)


if __name__ == "__main__":
    sys.exit(main())
