"""Structured-output backends (`pagedjax.structured.backend`): each built-in backend's masks
against brute force over a real vocabulary (byte-level BPE and SentencePiece), matcher
operations (consume, validate, rollback, fork, stop), batched fills equal row-by-row fills,
the compile cache, a third-party backend registered by name, and the engine on the
"outlines" backend (outputs validate under n > 1, preemption and speculative decoding)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from models.demo import GEMMA3_270M, ensure_model
from models.tokenizer import load_tokenizer
from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.structured import GuidedDecodingParams
from pagedjax.structured.backend import make_backend, register_backend
from pagedjax.structured.outlines import token_bytes
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.structured.test_structured import PROMPTS, SCHEMAS, _check_all

BACKENDS = ["guidance", "outlines"]
# Nested objects, enums, arrays, patterns, nullable strings: what outlines enforces (it
# refuses numeric bounds, which SCHEMAS use).
OUTLINES_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "size": {"enum": ["S", "M", "L"]}},
     "required": ["name", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
        "where": {"type": "object", "properties": {"north": {"type": "boolean"}},
                  "required": ["north"], "additionalProperties": False}},
     "required": ["city", "tags", "where"], "additionalProperties": False},
    SCHEMAS[2],
    {"type": "array", "items": {"enum": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, "minItems": 2,
     "maxItems": 4},
]
# A finite language, so the allowed next tokens of any prefix can be enumerated.
CHOICES = ["red", "green", "blue", "grey-blue", "re"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request, demo_gguf):
    path = demo_gguf if request.param == "smollm2" else ensure_model(GEMMA3_270M)
    return load_tokenizer(path)


def _unpack(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def _brute_force(tbytes: dict[int, bytes], prefix: bytes, language: list[bytes]) -> set[int]:
    """Tokens t with prefix + bytes(t) a prefix of some word of the language."""
    return {t for t, b in tbytes.items()
            if any(w.startswith(prefix + b) for w in language)}


@pytest.mark.parametrize("name", BACKENDS)
def test_masks_equal_brute_force(tokenizer, name):
    vocab = len(tokenizer)
    be = make_backend(name, tokenizer, vocab)
    tb = token_bytes(tokenizer)  # special tokens left out: a grammar never produces them
    language = [c.encode() for c in CHOICES]
    grammar = be.compile(GuidedDecodingParams(choice=CHOICES))
    eos = tokenizer.eos_token_id
    for word in ("grey-blue", "green", "re"):
        m = be.matcher(grammar)
        ids = tokenizer.encode(word, add_special_tokens=False)
        prefix = b""
        for t in [*ids, None]:
            row = np.empty(-(-vocab // 32), np.int32)
            m.fill(row)
            got = set(_unpack(row, vocab).tolist())
            want = _brute_force(tb, prefix, language)
            assert got - {eos} - set(tb) == set(), (name, word, "special tokens allowed")
            continuing = [w for w in language if w.startswith(prefix) and w != prefix]
            if name == "guidance" and len(continuing) == 1 and prefix not in language:
                # A forced continuation: llguidance keeps it canonically tokenized, allowing
                # only those of the fitting tokens the tokenizer would use.
                assert got & set(tb) and got & set(tb) <= want, (word, prefix)
            else:
                assert got & set(tb) == want, (name, word, prefix, sorted(got ^ want)[:10])
            # EOS exactly when the prefix is a whole word.
            assert (eos in got) == (prefix in language), (name, word, prefix)
            if t is None:
                break
            assert m.consume(t)
            prefix += tb[t]
        assert m.is_stopped() == (word != "re")  # "re" may go on to "red"


@pytest.mark.parametrize("name", BACKENDS)
def test_matcher_operations(demo_tokenizer, name):
    tok = demo_tokenizer
    vocab = len(tok)
    be = make_backend(name, tok, vocab)
    grammar = be.compile(GuidedDecodingParams(regex=r"ab(cd|ef)[0-9]{2}"))
    good = tok.encode("abcd12", add_special_tokens=False)
    bad = tok.encode("abzz", add_special_tokens=False)
    m = be.matcher(grammar)
    assert m.validate(good) == len(good)
    n_bad = m.validate(bad)
    assert n_bad < len(bad)
    assert m.consume(good[0])
    child = m.fork()
    first = np.empty(-(-vocab // 32), np.int32)
    m.fill(first)
    for t in good[1:]:
        assert m.consume(t)
    assert m.is_stopped()
    m.rollback(len(good) - 1)  # back to after good[0]
    again = np.empty_like(first)
    m.fill(again)
    assert np.array_equal(first, again)
    forked = np.empty_like(first)
    child.fill(forked)
    assert np.array_equal(first, forked)
    assert not child.is_stopped()
    assert not be.matcher(grammar).consume(tok.encode("z", add_special_tokens=False)[0])


@pytest.mark.parametrize("name", BACKENDS)
def test_batched_fill_equals_row_fills(demo_tokenizer, name):
    tok = demo_tokenizer
    vocab = len(tok)
    be = make_backend(name, tok, vocab)
    g = be.compile(GuidedDecodingParams(json=OUTLINES_SCHEMAS[0]))
    text = '{"name": "Ann", "size": "M"}'
    ids = tok.encode(text, add_special_tokens=False)
    matchers = []
    for k in range(len(ids) + 1):  # every prefix: > PARALLEL_FILL_ROWS matchers
        m = be.matcher(g)
        for t in ids[:k]:
            assert m.consume(t)
        matchers.append(m)
    assert len(matchers) > 8
    batch = np.zeros((len(matchers), -(-vocab // 32)), np.int32)
    be.fill_batch(matchers, batch)
    for m, row in zip(matchers, batch, strict=True):
        one = np.empty_like(row)
        m.fill(one)
        assert np.array_equal(one, row)
    assert matchers[-1].is_stopped()


def test_compile_cache_and_refusals(demo_tokenizer):
    tok = demo_tokenizer
    for name in BACKENDS:
        be = make_backend(name, tok, len(tok))
        p = GuidedDecodingParams(json=SCHEMAS[1])
        a = be.compile(p)
        hits = be.cache.hits
        assert be.compile(GuidedDecodingParams(json=json.dumps(SCHEMAS[1]))) is a
        assert be.cache.hits == hits + 1
    outlines = make_backend("outlines", tok, len(tok))
    for guide, field in (({"grammar": 'start: "a"'}, "guided_decoding.grammar"),
                         ({"json_object": True}, "guided_decoding.json_object"),
                         ({"regex": "[a-"}, "guided_decoding.regex"),
                         ({"json": SCHEMAS[0]}, "'minimum' (at properties.age)"),
                         ({"json": {"type": "array", "items": {"type": "integer"},
                                    "uniqueItems": True}}, "'uniqueItems'"),
                         ({"json": {"type": "string", "format": "ipv4"}},
                          "guided_decoding.json")):
        with pytest.raises(ValueError, match=re.escape(field)):
            outlines.compile(GuidedDecodingParams(**guide))
    # A property *named* like an unenforced keyword is fine.
    outlines.compile(GuidedDecodingParams(json={
        "type": "object", "properties": {"minimum": {"type": "boolean"}}, "required": ["minimum"]}))


def test_engine_config_names_the_backend():
    assert EngineConfig().structured_outputs_config == {"backend": "auto"}
    assert EngineConfig(structured_outputs_config='{"backend": "outlines"}') \
        .structured_outputs_config == {"backend": "outlines"}
    for bad, field in (({"backend": "nope"}, "structured_outputs_config.backend"),
                       ({"backend": "xgrammar"}, "structured_outputs_config.backend"),
                       ({"backend": "guidance", "x": 1}, "structured_outputs_config"),
                       ("{", "structured_outputs_config")):
        with pytest.raises(ValueError, match=re.escape(field)):
            EngineConfig(structured_outputs_config=bad)


@pytest.fixture(scope="module")
def make_llm(demo_model, demo_tokenizer):
    config, params = demo_model

    def make(backend: str, **kw) -> LLM:
        base = dict(num_gpu_blocks=48, block_size=16, max_model_len=256, max_num_seqs=8,
                    enable_prefix_caching=True,
                    structured_outputs_config={"backend": backend})
        return LLM.from_params(config, params, demo_tokenizer, **{**base, **kw})
    return make


def test_a_registered_backend_serves_the_engine(make_llm):
    """A third-party backend plugs in by name: here a wrapper that records its calls around
    the built-in guidance backend; the engine goes through it and the outputs are the
    default backend's."""
    calls = {"compile": 0, "matcher": 0, "fill_batch": 0}

    class Recording:
        name = "recording"

        def __init__(self, tokenizer, vocab_size):
            self.inner = make_backend("guidance", tokenizer, vocab_size)

        def compile(self, params):
            calls["compile"] += 1
            return self.inner.compile(params)

        def matcher(self, grammar):
            calls["matcher"] += 1
            return self.inner.matcher(grammar)

        def fill_batch(self, matchers, rows):
            calls["fill_batch"] += 1
            self.inner.fill_batch(matchers, rows)

    register_backend("recording", Recording)
    sps = [SamplingParams(temperature=0, max_tokens=100, guided_decoding={"json": s})
           for s in SCHEMAS]
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    got = make_llm("recording").chat(msgs, sps, use_tqdm=False)
    want = make_llm("guidance").chat(msgs, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert calls["compile"] == 4 and calls["matcher"] == 4 and calls["fill_batch"] > 10


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outlines_outputs_validate(make_llm, mode):
    """The "outlines" backend through the engine: greedy and seeded n = 2 outputs of four
    schemas under preemption all parse and validate; regex and choice outputs match."""
    llm = make_llm("outlines", num_gpu_blocks=32, block_size=8, preemption_mode=mode)
    greedy = [SamplingParams(temperature=0, max_tokens=100, guided_decoding={"json": s})
              for s in OUTLINES_SCHEMAS]
    sampled = [SamplingParams(temperature=0.7, top_p=0.95, seed=i, n=2, max_tokens=100,
                              guided_decoding={"json": s})
               for i, s in enumerate(OUTLINES_SCHEMAS)]
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS * 2]
    outs = llm.chat(msgs, greedy + sampled, use_tqdm=False)
    assert _check_all(outs, OUTLINES_SCHEMAS * 2) == 12
    assert llm.engine.get_stats().num_preemptions_total > 0
    regex, choices = r"[A-Z][a-z]{2,6} [0-9]{1,3}", ["red", "green", "blue"]
    outs = llm.chat(msgs[:2], [
        SamplingParams(temperature=0.9, seed=1, n=3, max_tokens=20, guided_decoding={"regex": regex}),
        SamplingParams(temperature=0.9, seed=2, n=3, max_tokens=20,
                       guided_decoding={"choice": choices})], use_tqdm=False)
    assert all(re.fullmatch(regex, o.text) for o in outs[0].outputs)
    assert all(o.text in choices for o in outs[1].outputs)
    assert len(llm.engine.structured) == 0
    assert_pool_whole(llm)


def test_outlines_under_speculative_decoding(make_llm):
    kw = dict(num_gpu_blocks=32, block_size=8)
    spec = make_llm("outlines", speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1}, **kw)
    plain = make_llm("outlines", **kw)
    sps = [SamplingParams(temperature=0, max_tokens=100, guided_decoding={"json": s})
           for s in OUTLINES_SCHEMAS]
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    got = spec.chat(msgs, sps, use_tqdm=False)
    want = plain.chat(msgs, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, schema in zip(got, OUTLINES_SCHEMAS, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert spec.engine.get_stats().spec_num_accepted_tokens > 0
    assert_pool_whole(spec)
