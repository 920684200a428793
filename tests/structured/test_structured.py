"""Structured outputs (`pagedjax.structured`) through the engine on the demo model and its
real tokenizer: every output parses and validates against its schema (checked with the
independent `jsonschema` package), regex and choice outputs match, under n > 1, preemption,
prefix caching, async scheduling and speculative decoding; bad schemas are refused naming
the field; the sampler's bitmask against a numpy reference; matchers and blocks released."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, apply_bitmask, sample
from pagedjax.structured import GuidedDecodingParams
from tests.engine.test_engine_e2e import assert_pool_whole

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "location": {"type": "object", "properties": {"lat": {"type": "number"},
                                                      "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "tags", "location"], "additionalProperties": False},
    {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["code", "ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 2, "maxItems": 4},
]
PROMPTS = ["Give me a JSON record about a person.", "Describe a trip as JSON.",
           "Return a status object.", "List a few small numbers."]


@pytest.fixture(scope="module")
def llm_factory(demo_model, demo_tokenizer):
    config, params = demo_model

    def make(**kw) -> LLM:
        base = dict(num_gpu_blocks=48, block_size=16, max_model_len=256, max_num_seqs=8,
                    enable_prefix_caching=True)
        return LLM.from_params(config, params, demo_tokenizer, **{**base, **kw})
    return make


def _chat(llm: LLM, sps) -> list:
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    return llm.chat(msgs, sps, use_tqdm=False)


def _check_all(outs, schemas) -> int:
    n = 0
    for out, schema in zip(outs, schemas, strict=True):
        for o in out.outputs:
            assert o.finish_reason == "stop", (o.text, o.finish_reason)
            jsonschema.validate(json.loads(o.text), schema)
            n += 1
    return n


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", False), ("swap", True)])
def test_every_output_validates(llm_factory, mode, async_scheduling):
    """Greedy and sampled (n = 2, seeded) outputs for four schemas, with preemption on a small
    pool: 100 % parse and validate; the pool and the matchers are released."""
    llm = llm_factory(num_gpu_blocks=32, block_size=8, preemption_mode=mode,
                      async_scheduling=async_scheduling)
    greedy = [SamplingParams(temperature=0, max_tokens=100, guided_decoding={"json": s})
              for s in SCHEMAS]
    sampled = [SamplingParams(temperature=0.7, top_p=0.95, seed=i, n=2, max_tokens=100,
                              guided_decoding={"json": s}) for i, s in enumerate(SCHEMAS)]
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS * 2]
    outs = llm.chat(msgs, greedy + sampled, use_tqdm=False)  # 12 sequences at once
    assert _check_all(outs, SCHEMAS * 2) == 12
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert len(llm.engine.structured) == 0
    assert_pool_whole(llm)


def test_regex_choice_grammar_and_json_object(llm_factory):
    llm = llm_factory()
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    choices = ["red", "green", "blue"]
    grammar = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'
    sps = [SamplingParams(temperature=0.9, seed=1, n=3, max_tokens=20,
                          guided_decoding={"regex": regex}),
           SamplingParams(temperature=0.9, seed=2, n=3, max_tokens=20,
                          guided_decoding={"choice": choices}),
           SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=20,
                          guided_decoding={"grammar": grammar}),
           SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=80,
                          guided_decoding={"json_object": True})]
    outs = _chat(llm, sps)
    for o in outs[0].outputs:
        assert re.fullmatch(regex, o.text), o.text
    for o in outs[1].outputs:
        assert o.text in choices
    for o in outs[2].outputs:
        assert re.fullmatch(r"x=[0-9]{1,4};", o.text), o.text
    for o in outs[3].outputs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert o.text.lstrip().startswith("{")
    assert len(llm.engine.structured) == 0


def test_unconstrained_neighbours_unchanged(llm_factory):
    """A constrained request in the batch changes nothing for the others (the sampler's
    full variant with all-ones masks is exact)."""
    llm = llm_factory()
    free = SamplingParams(temperature=0.8, seed=5, max_tokens=24)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    alone = llm.chat(msgs[:2], [free, free], use_tqdm=False)
    mixed = llm.chat(msgs, [free, free, SamplingParams(temperature=0, max_tokens=60,
                                                       guided_decoding={"json": SCHEMAS[2]}),
                            free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS[2])


def test_speculative_decoding_under_constraints(llm_factory):
    """n-gram drafts for constrained sequences are scored under the masks of their prefixes
    (a draft the grammar refuses is rejected): greedy outputs equal the unspeculated
    engine's, every output validates, and drafts were accepted."""
    kw = dict(num_gpu_blocks=32, block_size=8, max_num_seqs=8)
    spec = llm_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_min": 1}, **kw)
    plain = llm_factory(**kw)
    sps = [SamplingParams(temperature=0, max_tokens=100, guided_decoding={"json": s})
           for s in SCHEMAS]
    got, want = _chat(spec, sps), _chat(plain, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert _check_all(got, SCHEMAS) == 4
    st = spec.engine.get_stats()
    assert st.spec_num_accepted_tokens > 0
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens  # some refused or missed
    # Seeded sampling, n = 2, with drafts: the unspeculated engine's tokens, all valid.
    sampled = [SamplingParams(temperature=0.7, top_p=0.95, seed=i, n=2, max_tokens=100,
                              guided_decoding={"json": s}) for i, s in enumerate(SCHEMAS)]
    got, want = _chat(spec, sampled), _chat(plain, sampled)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    assert _check_all(got, SCHEMAS) == 8
    assert len(spec.engine.structured) == 0
    assert_pool_whole(spec)


def test_bad_constraints_are_refused_naming_the_field(llm_factory):
    llm = llm_factory()
    eng = llm.engine
    cases = [({"json": {"type": "objectx"}}, "guided_decoding.json"),
             ({"regex": "[a-z"}, "guided_decoding.regex"),
             ({"grammar": "start: ("}, "guided_decoding.grammar"),
             ({"json": "{not json"}, "guided_decoding.json"),
             ({"choice": []}, "guided_decoding.choice"),
             ({"regex": "a", "choice": ["b"]}, "exactly one"),
             ({"schema": {}}, "unknown field")]
    for guide, match in cases:
        with pytest.raises(ValueError, match=re.escape(match)):
            eng.add_request("bad", "hi", SamplingParams(guided_decoding=guide))
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0,
                       guided_decoding={"regex": "a"})
    assert not eng.has_unfinished_requests()
    assert len(eng.structured) == 0


def test_params_forms():
    a = GuidedDecodingParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    fmt, text = a.source()
    assert fmt == "json_schema" and list(json.loads(text)["properties"]) == ["b", "a"]
    assert GuidedDecodingParams.coerce({"choice": ["x", "y"]}).choice == ("x", "y")
    assert SamplingParams(guided_decoding={"json_object": True}).guided_decoding.kind == \
        "json_object"


def _pack(allowed: np.ndarray) -> np.ndarray:
    """Pack a [V] bool mask into int32 words, bit t % 32 of word t // 32 (numpy only)."""
    v = allowed.shape[0]
    w = -(-v // 32)
    bits = np.zeros(w * 32, np.uint8)
    bits[:v] = allowed
    return np.packbits(bits.reshape(w, 32), axis=1, bitorder="little").view("<u4").ravel() \
        .view(np.int32)


def test_bitmask_against_numpy():
    rng = np.random.default_rng(0)
    b, v = 6, 100
    logits = rng.normal(size=(b, v)).astype(np.float32)
    allowed = rng.random((b, v)) < 0.2
    allowed[:, 7] = True
    mask = np.stack([_pack(a) for a in allowed])
    got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    want = np.where(allowed, logits, -np.inf)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(got[allowed], logits[allowed])
    # Through the sampler: greedy and sampled rows only ever pick allowed tokens; an
    # unconstrained row (no mask) and the padding row are untouched.
    greedy = SamplingParams(temperature=0, max_tokens=4)
    hot = SamplingParams(temperature=2.0, seed=3, max_tokens=4)
    rows = [(greedy if i % 2 else hot, SeqSamplingState([1], [])) for i in range(b - 2)]
    rows.append((greedy, SeqSamplingState([1], [])))
    masks = {i: mask[i] for i in range(b - 2)}
    meta = SamplingMetadata.from_params(rows, pad_to=b, vocab_size=v, masks=masks)
    out = np.asarray(sample(jnp.asarray(logits), meta).token_ids)
    for i in range(b - 2):
        assert allowed[i, out[i]]
        if i % 2:
            assert out[i] == np.flatnonzero(allowed[i])[np.argmax(logits[i][allowed[i]])]
    assert out[b - 2] == np.argmax(logits[b - 2])  # greedy, unconstrained
