"""`ModelRunner.fetch` on one CPU device (`read_in_place`): a step's results read in place
give what `jax.device_get` gives, leaf for leaf, for the trees the engine fetches (a sampler
output with absent fields, host numpy leaves among device ones, beam candidates, None)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.sampler import SamplerOutput
from pagedjax.worker.model_runner import read_in_place


def test_read_in_place_gives_what_device_get_gives():
    rng = np.random.default_rng(3)
    b, k = 7, 3
    x = jnp.asarray(rng.normal(size=(b, 11)).astype(np.float32))
    out = jax.jit(lambda x: SamplerOutput(jnp.argmax(x, -1).astype(jnp.int32), x.max(-1),
                                          jnp.ones(b, jnp.int32), x[:, :k],
                                          jnp.argsort(x, -1)[:, :k].astype(jnp.int32), None))(x)
    # Greedy samplers' constant fields come from the host as numpy (stop 45).
    out = out._replace(ranks=np.ones(b, np.int32))
    cands = {"parent": jnp.arange(4), "score": jnp.linspace(0, 1, 4)}
    for tree in ((out, None, None), (out, cands, jnp.zeros((2, k)))):
        want = jax.device_get(tree)
        got = read_in_place(tree)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)


def test_a_cpu_engine_reads_its_results_in_place_with_the_same_outputs():
    """The one-CPU engine fetches through `read_in_place`; with `jax.device_get` instead its
    outputs (tokens, logprobs, top logprobs, a beam search) are the same."""
    from models.config import ModelConfig
    from models.weights import assemble_params
    from pagedjax import LLM, SamplingParams
    from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
    from tests.parallel.tp_script import NoTokenizer

    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    params = assemble_params(config, random_hf_tensors(config, seed=7).get)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, n)] for n in (5, 17, 30)]
    sps = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
           SamplingParams(temperature=0.7, seed=3, max_tokens=9, logprobs=2),
           SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=6,
                          ignore_eos=True)]
    outs = []
    for fetch in (None, jax.device_get):
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                              max_num_seqs=8, max_model_len=128)
        if fetch is None:
            assert llm.engine.runner.fetch is read_in_place
        else:
            llm.engine.runner.fetch = fetch
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], sps))
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks
    for a, b in zip(*outs, strict=True):
        assert [(c.token_ids, c.cumulative_logprob, c.logprobs) for c in a.outputs] == \
            [(c.token_ids, c.cumulative_logprob, c.logprobs) for c in b.outputs]
