"""Tool calling: the family parsers and the streaming state machine on hand-written outputs
(every split of each output streams the same content and calls as the finished output
parses to), request checks naming the field, and the official `openai` client against the
shared server (named and required calls constrained to the tools' schemas, a two-turn round
trip, streaming, and `auto` through the Hermes parser)."""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict

import jsonschema
import openai
import pytest

from pagedjax.serving.http import _assistant_message
from pagedjax.serving.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolDeltas,
    calls_from_constrained,
    check_tools,
    guided_for,
    openai_call_id,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]

W2 = '{"city": "Rome", "days": 2}'
TRICKY = ('{"q": "a \\"quoted\\" {brace} ] [TOOL_CALLS] </tool_call>", "n": [1, {"x": null}], '
          '"u": "caf\u00e9 \u2615"}')
# (output, content, [(name, arguments)]): what the finished output parses to; no calls:
# content is the whole output.
HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + W2 + '}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
     "Let me check.", [("get_weather", W2), ("get_time", '{"tz": "UTC"}')]),
    ('<tool_call>\n{"name": "search", "arguments": ' + TRICKY + '}\n</tool_call>', None,
     [("search", TRICKY)]),
    ('<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>', None,
     [("get_time", '{"tz": "CET"}')]),  # arguments before the name
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", '{"a": 1}')]),  # arguments as a JSON string
    ('<tool_call>{"name": "ping", "id": 7}</tool_call>', None, [("ping", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "Done.", [("f", "{}")]),
    ('Sure <tool_call>{"name": "f", "arguments": {"a": 1}}', "Sure", [("f", '{"a": 1}')]),
    ("I can answer: 2 < 3, and <tool is no tag.\n", None, []),
    ('Checking <tool_call>{"name": get_weather}</tool_call>', None, []),  # bad JSON: content
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name: content
    ("Almost <tool_cal", None, []),
]
LLAMA3 = [
    ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
     '{"name": "get_weather", "parameters": ' + W2 + '}', None,
     [("get_time", '{"tz": "UTC"}'), ("get_weather", W2)]),
    ('{"name": "get_weather", "parameters": ' + W2 + '}', None, [("get_weather", W2)]),
    ('\n\n{"name": "search", "arguments": ' + TRICKY + '};\n{"name": "ping"}', None,
     [("search", TRICKY), ("ping", "{}")]),
    ('Sure! {"name": "f", "parameters": {}}', None, []),  # a call is the whole message
    ('{"answer": 42}', None, []),  # JSON that is no call
    ("{x}", None, []),
    ("<|python_tag|>", None, []),
    ("<|python", None, []),
    ("<b>The answer is 4.</b>", None, []),
]
MISTRAL = [
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_weather", '
     '"arguments": ' + W2 + '}]', None, [("get_time", '{"tz": "UTC"}'), ("get_weather", W2)]),
    ('Let me look. [TOOL_CALLS] [{"name": "search", "arguments": ' + TRICKY + '}]',
     "Let me look.", [("search", TRICKY)]),
    ('[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}]', None,
     [("f", '{"a": [1, 2]}')]),
    ('[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    ("Use [TOOL] or [x] here.", None, []),
    ("[TOOL_CALLS] not json", None, []),
    ('[TOOL_CALLS][{"arguments": {"a": 1}}]', None, []),
]
PARSERS = [(HermesParser, c) for c in HERMES] + [(Llama3JsonParser, c) for c in LLAMA3] + \
    [(MistralParser, c) for c in MISTRAL]
# Malformed after the call's name was streamed: the finished output has no calls.
LATE_ERRORS = [
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}'),  # cut short
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}} and then text'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": }}]'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>'),
]


def _pieces(text: str, cuts) -> list[str]:
    cuts = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def _stream(deltas: ToolDeltas, pieces: list[str], finish: str = "stop"):
    """Chunks (deltas) of the pieces fed as generated, and the last finish reason."""
    chunks, reason = [], None
    for k, p in enumerate(pieces):
        out, reason = deltas.update(p, finish if k == len(pieces) - 1 else None)
        chunks += out
    return chunks, reason


def _collect(chunks: list[dict]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], headers) of streamed chunks, checking OpenAI's shape:
    one header per call (id, type, name, arguments ""), before its fragments, which carry
    only the index and arguments; an index at most once per chunk."""
    headers: dict[int, dict] = {}
    args: dict[int, str] = defaultdict(str)
    for c in chunks:
        entries = c.get("tool_calls", [])
        assert len({e["index"] for e in entries}) == len(entries), c
        for e in entries:
            i = e["index"]
            if "id" in e:
                assert i not in headers and i == len(headers), (i, headers)
                assert e["type"] == "function" and e["function"]["arguments"] == ""
                assert set(e["function"]) == {"name", "arguments"}
                headers[i] = e
            else:
                assert i in headers and set(e) == {"index", "function"}, e
                assert set(e["function"]) == {"arguments"} and e["function"]["arguments"]
                args[i] += e["function"]["arguments"]
    content = "".join(c.get("content", "") for c in chunks)
    calls = [(headers[i]["function"]["name"], args[i]) for i in sorted(headers)]
    return content, calls, [headers[i] for i in sorted(headers)]


def _client_deltas(chunks) -> list[dict]:
    """The deltas of the `openai` client's chunks, as sent (for `_collect`)."""
    return [c.delta.model_dump(exclude_unset=True) for ch in chunks for c in ch.choices]


def _splits(text: str, rng: random.Random):
    """Every split in two, one character at a time, and random chunkings."""
    yield [text]
    for k in range(1, len(text)):
        yield _pieces(text, [k])
    yield list(text)
    for _ in range(30):
        yield _pieces(text, rng.sample(range(1, len(text)), min(len(text) - 1,
                                                                 rng.randint(1, 12))))


@pytest.mark.parametrize("parser,case", PARSERS,
                         ids=[f"{p.__name__}-{i}" for i, (p, _) in enumerate(PARSERS)])
def test_parser_parse_and_stream_agree(parser, case):
    text, content, calls = case
    want_content = content if calls else text
    got_content, got_calls = parser().parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (want_content, calls)
    for c in got_calls:
        json.loads(c.arguments)
    rng = random.Random(text)
    for pieces in _splits(text, rng):
        chunks, finish = _stream(ToolDeltas("auto", parser()), pieces)
        s_content, s_calls, _ = _collect(chunks)
        assert (s_content, s_calls) == (want_content or "", calls), pieces
        assert finish == ("tool_calls" if calls else "stop")
    # Cut short by max_tokens: the finish reason stays "length".
    assert _stream(ToolDeltas("auto", parser()), [text], "length")[1] == "length"
    if calls:  # incremental: one character at a time, the first call's header comes as soon
        # as its name is complete (before the output ends), its arguments right after theirs
        ts = ToolDeltas("auto", parser())
        sent = [ts.update(c, None)[0] for c in text]
        first = min(k for k, d in enumerate(sent) if any("tool_calls" in x for x in d))
        name_end = text.index(f'"{calls[0][0]}"') + len(calls[0][0]) + 1
        assert first == name_end, (first, name_end)
        args0 = "".join(e["function"]["arguments"] for d in sent for x in d
                        for e in x.get("tool_calls", ()) if e["index"] == 0 and "id" not in e)
        assert args0 == calls[0][1]


@pytest.mark.parametrize("parser,text", LATE_ERRORS)
def test_malformed_after_the_name_is_content_when_finished(parser, text):
    """The finished output keeps it as content; the stream has sent the call's name (as
    vLLM's would) and sends the rest that is not arguments as content, without failing."""
    assert parser().parse(text) == (text, [])
    for pieces in ([text], list(text)):
        content, calls, _ = _collect(_stream(ToolDeltas("auto", parser()), pieces)[0])
        assert [name for name, _ in calls] == ["f"]


def test_required_and_named_stream_their_arguments():
    out = ('[{"name": "get_weather", "parameters": ' + W2 + '}, '
           '{"name": "get_time", "parameters": {"tz": "CET"}}]')
    want = [("get_weather", W2), ("get_time", '{"tz": "CET"}')]
    assert [(c.name, c.arguments) for c in calls_from_constrained(out, "required")] == want
    rng = random.Random(1)
    for pieces in _splits(out, rng):
        chunks, finish = _stream(ToolDeltas("required"), pieces)
        assert _collect(chunks)[:2] == ("", want) and finish == "tool_calls"
    # parallel_tool_calls false: the first call only.
    chunks, _ = _stream(ToolDeltas("required", parallel=False), list(out))
    assert _collect(chunks)[1] == want[:1]
    # A named call: the whole output is the arguments, streamed as generated.
    for pieces in _splits(W2, rng):
        chunks, finish = _stream(ToolDeltas("get_weather"), pieces)
        assert _collect(chunks)[:2] == ("", [("get_weather", W2)]) and finish == "stop"
    assert calls_from_constrained(W2, "get_weather") == [ToolCall("get_weather", W2)]
    assert calls_from_constrained('{"city": "Ro', "get_weather") == []  # cut short
    assert calls_from_constrained('[{"name": "get_time", "param', "required") == []


def test_call_ids():
    """OpenAI's style, except with the Mistral parser: its chat templates refuse an id that is
    not exactly 9 letters or digits."""
    ids = {MistralParser().call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids)
    assert re.fullmatch("call_[0-9a-f]{24}", HermesParser().call_id())
    assert re.fullmatch("call_[0-9a-f]{24}", openai_call_id())
    m = MistralParser()
    text = MISTRAL[0][0]
    msg, finish = _assistant_message(text, "stop", ("auto", m, True, m.call_id))
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 2
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in msg["tool_calls"])
    headers = _collect(_stream(ToolDeltas("auto", m, True, m.call_id), list(text))[0])[2]
    assert len(headers) == 2 and all(re.fullmatch("[A-Za-z0-9]{9}", h["id"]) for h in headers)
    h = HermesParser()
    msg, _ = _assistant_message(HERMES[0][0], "stop", ("auto", h, True, h.call_id))
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])


def test_stream_states():
    pieces = ["Sure. <to", "ol_call>{\"name\": \"get_time\", ", "\"arguments\": {\"tz\": \"CET\"}}",
              "</tool_call>"]
    ts = ToolDeltas("auto", HermesParser())
    out = [ts.update(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    assert out[0] == ([{"content": "Sure."}], None)  # the space is held: a call may follow
    # The header as soon as the name is complete, then the arguments as they come.
    (head,), _ = out[1]
    assert head["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert out[2] == ([{"tool_calls": [{"index": 0, "function": {"arguments":
                                                                   '{"tz": "CET"}'}}]}], None)
    assert out[3] == ([], "tool_calls")
    msg, finish = _assistant_message("plain answer", "stop",
                                     ("auto", HermesParser(), True, openai_call_id))
    assert msg == {"role": "assistant", "content": "plain answer"} and finish == "stop"


def test_request_checks():
    with pytest.raises(ValueError, match="tools.0"):
        check_tools([{"type": "retrieval"}], None)
    with pytest.raises(ValueError, match="tools.0.function.name"):
        check_tools([{"type": "function", "function": {"name": "bad name"}}], None)
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        check_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice"):
        check_tools(None, "required")
    assert check_tools(TOOLS, None)[1] == "auto" and check_tools(TOOLS, "none")[1] is None
    schema = guided_for(check_tools(TOOLS, "required")[0], "required")["json"]
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Rome"}}], schema)


def test_named_and_required_calls_round_trip(oai):
    model = oai.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Rome for the next days?"}]
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=60,
                                    temperature=0, tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Turn two: the call and its result go back; the template renders them.
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    r2 = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=12,
                                     temperature=0, tool_choice="none")
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    # Required: one call or more, each one of the tools with valid arguments.
    r3 = oai.chat.completions.create(model=model, messages=msgs[:1], tools=TOOLS, max_tokens=80,
                                     temperature=0.7, seed=3, tool_choice="required",
                                     parallel_tool_calls=False)
    assert r3.choices[0].finish_reason == "tool_calls"
    assert len(r3.choices[0].message.tool_calls) == 1  # parallel_tool_calls=False
    for c in r3.choices[0].message.tool_calls:
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), spec["parameters"])
    # Streamed, the same (seeded) call: its header, then its arguments in fragments.
    chunks = list(oai.chat.completions.create(
        model=model, messages=msgs[:1], tools=TOOLS, max_tokens=80, temperature=0.7, seed=3,
        tool_choice="required", parallel_tool_calls=False, stream=True))
    content, calls, _ = _collect(_client_deltas(chunks))
    assert not content and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments)
                     for c in r3.choices[0].message.tool_calls]
    # Streaming a named call: the argument deltas add up to valid JSON.
    chunks = list(oai.chat.completions.create(
        model=model, messages=msgs[:1], tools=TOOLS, max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    content, calls, headers = _collect(_client_deltas(chunks))
    assert not content and calls == [("get_weather", call.function.arguments)]
    assert headers[0]["id"].startswith("call_")


def test_auto_through_the_hermes_parser(oai):
    """`auto` parses what the model writes; a regex makes this small model write a Hermes
    call, so the parse path runs end to end (streamed and not)."""
    model = oai.models.list().data[0].id
    form = (r'<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}'
            r'</tool_call>')
    kw = dict(model=model, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
              max_tokens=40, temperature=0, extra_body={"guided_regex": form})
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in \
        ("UTC", "CET")
    assert call.id.startswith("call_") and r.choices[0].message.content is None
    # Streamed: the header once the name is out, then the arguments as they are generated;
    # the fragments add up to the same arguments.
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    content, calls, _ = _collect(_client_deltas(chunks))
    assert not content and calls == [("get_time", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                        tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def test_refusals(oai):
    model = oai.models.list().data[0].id
    msgs = [{"role": "user", "content": "x"}]
    for kw, field in [(dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools"),
                      (dict(tools=TOOLS, tool_choice="required",
                            response_format={"type": "json_object"}), "tool_choice"),
                      (dict(extra_body={"functions": [{"name": "f"}]}), "functions")]:
        with pytest.raises(openai.BadRequestError, match=field):
            oai.chat.completions.create(model=model, messages=msgs, max_tokens=2, **kw)
