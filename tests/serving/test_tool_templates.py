"""Tools through a tool-aware chat template and the Llama 3 and Mistral parsers end to end.

One demo-model engine with a Hermes/Qwen-style `--chat-template` (it lists the tools' JSON
schemas, renders assistant `tool_calls` and `tool` turns), served HTTP-only in-process with
each `--tool-call-parser` in turn: the tools' JSON reaches the prompt (/tokenize, and the
same prompt length through /v1/chat/completions), calls and tool results round-trip into the
template, and `auto` parses the Llama 3 JSON and Mistral formats (a `guided_regex` makes the
135M demo model write them), streamed and not, with Mistral's 9-character call ids."""

from __future__ import annotations

import contextlib
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.serving.inproc import InProcessServer
from tests.serving.test_tools import TOOLS, _client_deltas, _collect

TEMPLATE = r"""
{%- if tools %}
{{- "<|im_start|>system\nYou may call these functions:\n<tools>" }}
{%- for tool in tools %}{{ "\n" + (tool | tojson) }}{% endfor %}
{{- "\n</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>" }}
{{- "<|im_end|>\n" }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}
{{- "<|im_start|>assistant" }}
{%- for tc in m.tool_calls %}
{{- "\n<tool_call>\n{\"name\": " + (tc.function.name | tojson) + ", \"arguments\": "
    + (tc.function.arguments | tojson) + ", \"id\": " + (tc.id | tojson) + "}\n</tool_call>" }}
{%- endfor %}
{{- "<|im_end|>\n" }}
{%- elif m.role == "tool" %}
{{- "<|im_start|>user\n<tool_response call=\"" + m.tool_call_id + "\">\n" + m.content
    + "\n</tool_response><|im_end|>\n" }}
{%- else %}
{{- "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ "<|im_start|>assistant\n" }}{% endif %}"""

ASK = [{"role": "user", "content": "What is the weather in Rome, and the time?"}]
CALL = {"id": "call_0123", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}
TURNS = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_0123", "content": '{"forecast": "sunny"}'}]


@pytest.fixture(scope="module")
def engine(demo_gguf, tmp_path_factory):
    from pagedjax.engine import LLMEngine

    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TEMPLATE)
    # What `serve --chat-template FILE` does.
    eng = LLMEngine.from_model(str(demo_gguf), "float32", chat_template=str(path),
                               num_gpu_blocks=96, max_model_len=768, max_num_seqs=4)
    eng.sampled = []  # (request id, skip_special_tokens) of every request the server adds
    add = eng.add_request

    def recording_add(request_id, prompt, params=None, *args, **kwargs):
        eng.sampled.append((request_id, params.skip_special_tokens))
        return add(request_id, prompt, params, *args, **kwargs)

    eng.add_request = recording_add
    return eng


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """`served(parser)`: the engine behind an HTTP-only server with `--enable-auto-tool-choice
    --tool-call-parser parser`; yields (httpx client, openai client, model id)."""

    @contextlib.contextmanager
    def serve(parser: str):
        srv = InProcessServer(engine, tmp_path_factory.mktemp(parser), port=None,
                              metrics_port=None, http_port=0, tool_call_parser=parser).start()
        base = f"http://127.0.0.1:{srv.ports['http_port']}"
        try:
            with httpx.Client(base_url=base, timeout=300) as http, \
                    openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                  timeout=300) as oai:
                yield http, oai, engine.model_name
        finally:
            assert srv.close() == 0

    return serve


def _prompt(http: httpx.Client, body: dict) -> tuple[str, int]:
    """The prompt text the model sees for a chat request (through /tokenize and back)."""
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    return text, len(tokens)


def test_tools_and_tool_turns_reach_the_chat_template(served):
    with served("hermes") as (http, oai, model):
        text, count = _prompt(http, {"messages": ASK, "tools": TOOLS})
        listed = re.search(r"<tools>\n(.*)\n</tools>", text, re.S).group(1).splitlines()
        # The tools' JSON as the template got it (OpenAI's shape; a missing description is "").
        assert [json.loads(line) for line in listed] == [
            {"type": "function", "function": {"name": t["function"]["name"],
                                              "description": t["function"].get("description", ""),
                                              "parameters": t["function"]["parameters"]}}
            for t in TOOLS]
        assert ASK[0]["content"] in text and text.endswith("<|im_start|>assistant\n")
        plain, plain_count = _prompt(http, {"messages": ASK})
        assert "<tools>" not in plain and plain_count < count
        # The same prompt through /v1/chat/completions (the tools shown even with "none").
        r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                        tool_choice="none", max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == count
        # Turn two: the assistant's call (arguments as an object) and the tool's result.
        text, count = _prompt(http, {"messages": TURNS, "tools": TOOLS})
        call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", text).group(1))
        assert call == {"name": "get_weather", "arguments": {"city": "Rome", "days": 2},
                        "id": "call_0123"}
        assert '<tool_response call="call_0123">\n{"forecast": "sunny"}\n</tool_response>' in text
        r = oai.chat.completions.create(model=model, messages=TURNS, tools=TOOLS,
                                        tool_choice="none", max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == count
        bad = http.post("/tokenize", json={"messages": ASK, "tools": [{"type": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def _auto(oai, model, regex: str, **kw) -> tuple:
    """The same forced output, not streamed and streamed: (message, finish, streamed)."""
    args = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                extra_body={"guided_regex": regex}, **kw)
    r = oai.chat.completions.create(**args)
    chunks = list(oai.chat.completions.create(stream=True, **args))
    content, calls, headers = _collect(_client_deltas(chunks))
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    return r.choices[0].message, r.choices[0].finish_reason, (content, calls, headers)


def _check_calls(message, names: list[str]) -> list[tuple[str, str]]:
    assert [c.function.name for c in message.tool_calls] == names
    for c in message.tool_calls:
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), spec["parameters"])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_auto_through_the_llama3_json_parser(served, engine):
    regex = (r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"tz": "(UTC|CET)"\}\}; '
             r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", '
             r'"days": [1-7]\}\}')
    with served("llama3_json") as (_, oai, model):
        message, finish, (content, calls, headers) = _auto(oai, model, regex)
        assert finish == "tool_calls" and message.content is None
        want = _check_calls(message, ["get_time", "get_weather"])
        assert all(c.id.startswith("call_") for c in message.tool_calls)
        assert content == "" and calls == want  # streamed: the same calls, piece by piece
        assert all(h["id"].startswith("call_") for h in headers)
        # Not Llama 3's format (text first): plain content.
        message, finish, (content, calls, _) = _auto(oai, model, r"Sure! \{\"name\": \"x\"\}")
        assert message.content == content == 'Sure! {"name": "x"}' and not calls
        assert not message.tool_calls and finish == "stop"
    assert {skip for _, skip in engine.sampled[-4:]} == {True}


def test_auto_through_the_mistral_parser(served, engine):
    regex = (r'Sure\. \[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": '
             r'"(Paris|Rome)", "days": [1-7]\}\}, \{"name": "get_time", "arguments": '
             r'\{"tz": "(UTC|CET)"\}\}\]')
    nine = re.compile("[A-Za-z0-9]{9}")
    with served("mistral") as (_, oai, model):
        message, finish, (content, calls, headers) = _auto(oai, model, regex)
        assert finish == "tool_calls" and message.content == "Sure."
        want = _check_calls(message, ["get_weather", "get_time"])
        assert all(nine.fullmatch(c.id) for c in message.tool_calls), message.tool_calls
        assert content == "Sure." and calls == want
        assert all(nine.fullmatch(h["id"]) for h in headers)
        # [TOOL_CALLS] is a control token of Mistral's tokenizers: decoding keeps it.
        assert {skip for _, skip in engine.sampled[-2:]} == {False}
        # Calls the server constrains take the parser's id style too.
        r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=40,
                                        temperature=0, tool_choice={
                                            "type": "function", "function": {"name": "get_time"}})
        (call,) = r.choices[0].message.tool_calls
        assert nine.fullmatch(call.id) and call.function.name == "get_time"
        # The ids round-trip: a Mistral template checks them; this one renders them.
        turns = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
        r2 = oai.chat.completions.create(model=model, messages=turns, tools=TOOLS,
                                         tool_choice="none", max_tokens=2, temperature=0)
        assert r2.choices[0].finish_reason in ("stop", "length")
