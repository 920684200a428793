"""`logit_bias`, `allowed_token_ids` and `bad_words` through the engine on the demo model:
each changes exactly what it says (checked against the unconstrained run and by brute force
over the outputs), ids outside the vocabulary are refused naming the field, and neighbours
in the batch are unaffected."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from tests.engine.test_engine_e2e import assert_pool_whole

PROMPTS = ["The capital of France is", "My favourite colour is", "Once upon a time,"]


@pytest.fixture(scope="module")
def llm(demo_model, demo_tokenizer):
    config, params = demo_model
    return LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64, block_size=16,
                           max_model_len=256, max_num_seqs=8)


def _gen(llm, sps):
    return llm.generate(PROMPTS, sps, use_tqdm=False)


def test_logit_bias(llm):
    plain = SamplingParams(temperature=0, max_tokens=8)
    base = _gen(llm, [plain] * 3)
    first = base[0].outputs[0].token_ids[0]
    forced = 1234
    sps = [SamplingParams(temperature=0, max_tokens=8, logit_bias={str(forced): 100}),
           SamplingParams(temperature=0, max_tokens=8, logit_bias={first: -100}), plain]
    got = _gen(llm, sps)
    assert got[0].outputs[0].token_ids == [forced] * 8  # +100 wins every step
    assert got[1].outputs[0].token_ids[0] != first
    assert got[2].outputs[0].token_ids == base[2].outputs[0].token_ids  # a neighbour: unchanged
    assert_pool_whole(llm)


def test_allowed_token_ids(llm, demo_tokenizer):
    allowed = demo_tokenizer.encode(" red green blue and or", add_special_tokens=False)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, allowed_token_ids=allowed)
           for i in range(3)]
    for out in _gen(llm, sps):
        assert set(out.outputs[0].token_ids) <= set(allowed)
    # Greedy: the argmax over the allowed ids, by brute force on the first step's logprobs.
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    lp = _gen(llm, [sp] * 3)[0].outputs[0].logprobs[0]
    want = max((t for t in allowed if t in lp), key=lambda t: lp[t], default=None)
    got = _gen(llm, [SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)]
               * 3)[0].outputs[0].token_ids[0]
    if want is not None:
        assert got == want
    assert got in allowed


def test_bad_words(llm, demo_tokenizer):
    plain = _gen(llm, [SamplingParams(temperature=0, max_tokens=24)] * 3)
    words = []
    for out in plain:  # a word each greedy output contains
        text = [w.strip(".,:;!?") for w in out.outputs[0].text.split()]
        words.append(next(w for w in text if w.isalpha() and len(w) >= 3))
    sps = [SamplingParams(temperature=0, max_tokens=24, bad_words=[w]) for w in words]
    got = _gen(llm, sps)
    for out, w in zip(got, words, strict=True):
        ids = out.outputs[0].token_ids
        for variant in (w, " " + w):
            seq = demo_tokenizer.encode(variant, add_special_tokens=False)
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (w, out.outputs[0].text)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in plain]


def test_refusals_name_the_field(llm):
    vocab = llm.engine.model_config.vocab_size
    for sp, field in [({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                      ({"logit_bias": {1: 101.0}}, "logit_bias"),
                      ({"logit_bias": {"x": 1.0}}, "logit_bias"),
                      ({"allowed_token_ids": [vocab + 3]}, "allowed_token_ids"),
                      ({"allowed_token_ids": []}, "allowed_token_ids"),
                      ({"bad_words": [""]}, "bad_words")]:
        with pytest.raises(ValueError, match=field):
            llm.engine.add_request("bad", "hi", SamplingParams(**sp))
    assert not llm.engine.has_unfinished_requests()


def test_bias_reaches_the_sampler_exactly():
    """Sampler level: bias added to exactly the listed logits (numpy reference)."""
    import jax.numpy as jnp

    from pagedjax.sampler import SamplingMetadata, SeqSamplingState, sample

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    bias = {3: 5.0, 7: -2.5, 49: 10.0}
    rows = [(SamplingParams(temperature=0, max_tokens=2, logit_bias=bias if i % 2 else None),
             SeqSamplingState([1], [])) for i in range(4)]
    meta = SamplingMetadata.from_params(rows, pad_to=4, vocab_size=50, bias_width=8)
    out = np.asarray(sample(jnp.asarray(logits), meta).token_ids)
    ref = logits.copy()
    for t, b in bias.items():
        ref[1::2, t] += b
    assert out.tolist() == ref.argmax(-1).tolist()
