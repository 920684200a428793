"""Tool calling for the OpenAI chat API: request checks, the constraint that makes a required or
named call valid by construction, and output parsers per model family.

- ``tool_choice`` named (``{"type": "function", "function": {"name": ...}}``): the output is
  the function's arguments, constrained to its ``parameters`` schema (structured outputs), so
  they always parse and validate; no parser is involved.
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, one of the
  given functions each, also constrained.
- ``"auto"`` (with ``serve --enable-auto-tool-choice --tool-call-parser NAME``, as vLLM): the
  model writes calls in its family's format and the parser finds them:
  ``hermes`` (Qwen 2.5/3, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  ``llama3_json`` (Llama 3.x: a JSON object ``{"name": ..., "parameters": {...}}``, several
  separated by ``;``, optionally after ``<|python_tag|>``), ``mistral``
  (``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``).
- ``"none"``, or no tools: plain chat.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def check_tools(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict], str | None]:
    """Validate ``tools`` and ``tool_choice``; returns (the functions, the mode: None (no
    tools used), "auto", "required", or the named function's name). Errors name the field."""
    funcs = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ValueError(f"tools.{i}: must be {{'type': 'function', 'function': {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools.{i}.function.name: 1-64 letters, digits, '_', '.' or '-'")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools.{i}.function.parameters: must be a JSON schema object")
        funcs.append({"name": name, "description": f.get("description", ""),
                      "parameters": params})
    if len(funcs) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} functions")
    if len({f["name"] for f in funcs}) != len(funcs):
        raise ValueError("tools: function names must be unique")
    if tool_choice is None:
        tool_choice = "auto" if funcs else "none"
    if tool_choice == "none":
        return funcs, None
    if not funcs:
        raise ValueError("tool_choice: needs tools")
    if tool_choice in ("auto", "required"):
        return funcs, tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in {f["name"] for f in funcs}:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
        return funcs, name
    raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")


def guided_for(funcs: list[dict], mode: str, parallel: bool = True) -> dict | None:
    """The structured-output constraint of a required or named call (None for auto);
    ``parallel`` False (OpenAI's ``parallel_tool_calls``): at most one call."""
    if mode == "auto":
        return None
    if mode == "required":
        one = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "parameters": f["parameters"]},
                "required": ["name", "parameters"], "additionalProperties": False}
               for f in funcs]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
        if not parallel:
            schema["maxItems"] = 1
        return {"json": schema}
    f = next(f for f in funcs if f["name"] == mode)
    return {"json": f["parameters"]}


def calls_from_constrained(text: str, mode: str) -> list[ToolCall]:
    """The calls of a required or named output (valid by construction; a cut-short output,
    finish_reason "length", may not parse: then no calls)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if mode == "required":
        return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in value]
    return [ToolCall(mode, json.dumps(value))]


def template_tools(funcs: list[dict]) -> list[dict]:
    """The functions as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in funcs]


# ---- parsers of free-form ("auto") output ---------------------------------------------------
class ToolParser:
    """Finds tool calls in a finished output. ``marker``: text at which calls begin (the
    streaming path forwards content up to it and holds back the rest)."""

    marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls or None, calls); no calls: (text, [])."""
        raise NotImplementedError

    def split(self, text: str) -> int:
        """Index where calls may begin in ``text`` (len(text) if nowhere yet; a prefix of the
        marker at the end is held back)."""
        i = text.find(self.marker)
        if i >= 0:
            return i
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def _decode_objects(s: str) -> list[Any]:
    """JSON values one after another (whitespace, ';' or ',' between them)."""
    dec, i, out = json.JSONDecoder(), 0, []
    while i < len(s):
        while i < len(s) and s[i] in " \t\r\n;,":
            i += 1
        if i >= len(s):
            break
        value, i = dec.raw_decode(s, i)
        out.append(value)
    return out


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class HermesParser(ToolParser):
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        i = text.find(self.marker)
        if i < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[i:]):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return (text[:i].strip() or None), calls


class Llama3JsonParser(ToolParser):
    marker = "{"

    def parse(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.startswith("{"):
            return text, []
        try:
            objs = _decode_objects(body)
        except json.JSONDecodeError:
            return text, []
        calls = [_call(o, "parameters") for o in objs]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls

    def split(self, text):  # a call is the whole message: it starts with "{" or the tag
        s = text.lstrip()
        if not s or s.startswith("{") or "<|python_tag|>".startswith(s[:14]) \
                or s.startswith("<|python_tag|>"):
            return 0
        return len(text)


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text):
        i = text.find(self.marker)
        if i < 0:
            return text, []
        try:
            objs = _decode_objects(text[i + len(self.marker):])
        except json.JSONDecodeError:
            return text, []
        flat = [o for v in objs for o in (v if isinstance(v, list) else [v])]
        calls = [_call(o, "arguments") for o in flat]
        if not calls or any(c is None for c in calls):
            return text, []
        return (text[:i].strip() or None), calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def make_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: one of {sorted(TOOL_PARSERS)}; got {name!r}")
    return TOOL_PARSERS[name]()
