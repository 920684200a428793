"""Tool calling: the family parsers and the streaming state machine on hand-written outputs,
request checks naming the field, and the official `openai` client against the shared server
(named and required calls constrained to the tools' schemas, a two-turn round trip, streaming,
and `auto` through the Hermes parser)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedjax.serving.http import _assistant_message, _ToolStream
from pagedjax.serving.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    check_tools,
    guided_for,
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


def test_parsers():
    h = HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
            '"days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": '
            '"UTC"}}</tool_call>')
    content, calls = h.parse(text)
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", '{"city": "Rome", "days": 2}'),
                     ToolCall("get_time", '{"tz": "UTC"}')]
    assert h.parse("no calls here") == ("no calls here", [])
    assert h.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    ll = Llama3JsonParser()
    assert ll.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", '
                    '"parameters": {}}')[1] == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]
    assert ll.parse("Hello {x}") == ("Hello {x}", [])
    m = MistralParser()
    assert m.parse('[TOOL_CALLS][{"name": "f", "arguments": {"b": [1]}}]') == \
        (None, [ToolCall("f", '{"b": [1]}')])
    # Streaming: content goes out up to where a marker may begin.
    assert h.split("abc <tool") == len("abc ") and h.split("abc") == 3
    assert h.split("x <tool_call>{") == 2


def test_stream_states():
    pieces = ["Sure. <to", "ol_call>{\"name\": \"get_time\", ", "\"arguments\": {\"tz\": \"CET\"}}",
              "</tool_call>"]
    ts, out = _ToolStream("auto", HermesParser()), []
    for i, p in enumerate(pieces):
        out.append(ts.delta(p, "stop" if i == len(pieces) - 1 else None))
    content = "".join(d.get("content", "") for d, _ in out)
    assert content == "Sure. "
    last, finish = out[-1]
    assert finish == "tool_calls" and last["tool_calls"][0]["function"] == \
        {"name": "get_time", "arguments": '{"tz": "CET"}'}
    ts = _ToolStream("get_weather", None)  # named: the arguments stream as generated
    chunks = [ts.delta(p, None)[0] for p in ['{"city": ', '"Paris", "days": 3}']]
    assert chunks[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(c["tool_calls"][0]["function"]["arguments"] for c in chunks) == \
        '{"city": "Paris", "days": 3}'
    msg, finish = _assistant_message("plain answer", "stop", ("auto", HermesParser(), True))
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
    # Streaming a named call: the argument deltas add up to valid JSON.
    chunks = list(oai.chat.completions.create(
        model=model, messages=msgs[:1], tools=TOOLS, max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    args = "".join(tc.function.arguments or "" for ch in chunks for c in ch.choices
                   for tc in (c.delta.tool_calls or []))
    assert json.loads(args) == json.loads(call.function.arguments)


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
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_time"]
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
