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
  (``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; call ids of 9 letters and
  digits, as Mistral's templates require).
- ``"none"``, or no tools: plain chat.

Streaming (`ToolDeltas`): the text is read as it arrives (`ToolCallStream`, one character at
a time, following JSON strings and nesting); a call's header goes out once its name is
complete and its arguments' JSON text follows in fragments, in OpenAI's delta shape, for
every mode. The arguments of a call are the JSON text the model wrote (a JSON string value
decoded), so the fragments add up to the final call's ``arguments`` exactly.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128
_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's chat templates refuse a tool-call id that is not exactly 9 letters or
    digits (as vLLM generates them for its Mistral parser)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None, call_id: str | None = None) -> dict[str, Any]:
        d = {"id": call_id or openai_call_id(), "type": "function",
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
    finish_reason "length", may not parse: then no calls). Arguments are the generated JSON
    text itself, so the streamed fragments add up to them exactly."""
    if mode == "required":
        s = RequiredStream()
        s.feed(text)
        s.finish()
        return [] if s.failed else s.calls
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return []
    return [ToolCall(mode, text)]


def template_tools(funcs: list[dict]) -> list[dict]:
    """The functions as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in funcs]


# ---- reading calls out of text, as it is generated ------------------------------------------
_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")


class _Malformed(ValueError):
    """The text stops being a tool call: it is content after all."""


class _JsonValue:
    """Follows one JSON value a character at a time (strings, escapes, nesting) without
    building it: enough to know which characters belong to it and where it ends. Whether it
    is valid JSON is checked once it is complete."""

    __slots__ = ("kind", "depth", "in_str", "esc")

    def __init__(self) -> None:
        self.kind: str | None = None  # container | string | scalar
        self.depth, self.in_str, self.esc = 0, False, False

    def feed(self, c: str) -> tuple[bool, bool]:
        """(``c`` belongs to the value, the value is complete)."""
        if self.kind is None:
            if c in "{[":
                self.kind, self.depth = "container", 1
            elif c == '"':
                self.kind, self.in_str = "string", True
            elif c in "-0123456789tfn":
                self.kind = "scalar"
            else:
                raise _Malformed(f"unexpected {c!r}")
            return True, False
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                return True, self.kind == "string"
            return True, False
        if self.kind == "scalar":  # ends at the first character that is not part of it
            return (False, True) if c in _WS or c in ",}]" else (True, False)
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return True, self.depth == 0
        return True, False


class _CallObject:
    """One call object, ``{"name": ..., "arguments": {...}}`` (``"parameters"`` also names
    the arguments; other keys are skipped), read a character at a time. ``events`` gets
    ("call", name) once the name's string closes and ("args", text) fragments of the
    arguments' JSON text as they are read (text read before the name follows the name at
    once); arguments given as a JSON string are decoded and sent whole."""

    def __init__(self) -> None:
        self.state = "open"
        self.raw: list[str] = []  # the object's text, validated whole at its end
        self.buf: list[str] = []  # the key or value being read
        self.value = _JsonValue()
        self.key: str | None = None
        self.keys = 0
        self.name: str | None = None
        self.arguments: str | None = None
        self.held: list[str] = []  # argument text read before the name
        self.events: list[tuple[str, str]] = []
        self.done = False

    def feed(self, c: str) -> None:
        self.raw.append(c)
        self._step(c)

    def _args(self, text: str) -> None:
        if self.name is None:
            self.held.append(text)
        else:
            self.events.append(("args", text))

    def _step(self, c: str) -> None:
        st = self.state
        if st == "open":
            if c != "{":
                raise _Malformed("a call is a JSON object")
            self.state = "key"
        elif st == "key":
            if c in _WS:
                return
            if c == "}" and not self.keys:
                self._close()
                return
            if c != '"':
                raise _Malformed(f"unexpected {c!r}")
            self.keys += 1
            self.value, self.buf, self.state = _JsonValue(), [c], "in_key"
            self.value.feed(c)
        elif st == "in_key":
            self.buf.append(c)
            if self.value.feed(c)[1]:
                self.key, self.state = json.loads("".join(self.buf)), "colon"
        elif st == "colon":
            if c in _WS:
                return
            if c != ":":
                raise _Malformed(f"unexpected {c!r}")
            self.state = "value"
        elif st == "value":
            if c in _WS:
                return
            if self.key == "name" and (c != '"' or self.name is not None):
                raise _Malformed("name: one string")
            if self.key in _ARG_KEYS and self.arguments is not None:
                raise _Malformed("arguments given twice")
            self.value, self.buf, self.state = _JsonValue(), [], "in_value"
            self._step(c)
        elif st == "in_value":
            mine, complete = self.value.feed(c)
            if mine:
                self.buf.append(c)
                if self.key in _ARG_KEYS and self.value.kind == "container":
                    self._args(c)
            if complete:
                self._value_done()
                self.state = "after"
                if not mine:
                    self._step(c)
        else:  # after a value
            if c in _WS:
                return
            if c == ",":
                self.state = "key"
            elif c == "}":
                self._close()
            else:
                raise _Malformed(f"unexpected {c!r}")

    def _value_done(self) -> None:
        text = "".join(self.buf)
        value = json.loads(text)  # a ValueError if it is not JSON
        if self.key == "name":
            self.name = value
            self.events.append(("call", value))
            if self.held:
                self.events.append(("args", "".join(self.held)))
                self.held = []
        elif self.key in _ARG_KEYS:
            self.arguments = value if isinstance(value, str) else text
            if self.value.kind != "container":
                self._args(self.arguments)

    def _close(self) -> None:
        json.loads("".join(self.raw))
        if self.name is None:
            raise _Malformed("a call needs a name")
        if self.arguments is None:
            self.arguments = "{}"
            self._args("{}")
        self.done = True


class ToolCallStream:
    """Splits one output into content and tool calls as it is generated. ``feed(text)``
    returns events: ("content", text); ("call", index, name) once a call's name is complete;
    ("args", index, text), fragments of the call's arguments as their JSON text arrives
    (joined, they are the final ``ToolCall.arguments``). ``finish()`` at the end of the output.

    Whitespace next to a call is not content. Text that could still begin a call is held
    back; once it cannot be one (bad JSON, no name), it goes out as content, and so does the
    rest of the output (``failed``). A call whose name was sent cannot be taken back: if it
    turns out malformed or is cut short, the non-streaming ``parse`` of the same text finds
    no calls, as vLLM's parsers do."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.failed = False
        self._out: list[tuple] = []
        self._state = "text"
        self._raw = False  # everything from here on is content
        self._ws = ""  # whitespace held back: not content if a call follows
        self._after_call = False  # whitespace right after a call is dropped
        self._hold = ""  # what may be the beginning of a marker
        self._region: list[str] | None = None  # a call not announced yet (content if it fails)
        self._obj: _CallObject | None = None
        self._n = 0  # calls announced

    # -- events ---------------------------------------------------------------------------
    def _emit(self, ev: tuple) -> None:
        if ev[0] == "content":
            self.content.append(ev[1])
        last = self._out[-1] if self._out else None
        if last is not None and last[:-1] == ev[:-1]:
            self._out[-1] = (*ev[:-1], last[-1] + ev[-1])
        else:
            self._out.append(ev)

    def _take(self) -> list[tuple]:
        out, self._out = self._out, []
        return [e for e in out if e[-1] or e[0] == "call"]

    def _content(self, c: str) -> None:
        if c in _WS:
            if not self._after_call:
                self._ws += c
            return
        self._after_call = False
        self._emit(("content", self._ws + c))
        self._ws = ""

    def _begin_call(self, text: str) -> None:
        """A call may begin: ``text`` (a marker, "{") and the whitespace before it are held."""
        self._region = [self._ws, text]
        self._ws = ""

    def _obj_char(self, c: str) -> bool:
        """Feeds the current call object; True once it is complete."""
        obj = self._obj
        obj.feed(c)
        for kind, text in obj.events:
            if kind == "call":
                self._n += 1
                self._region = None  # announced: its text is not content
                self._emit(("call", self._n - 1, text))
            else:
                self._emit(("args", self._n - 1, text))
        obj.events.clear()
        if obj.done:
            self.calls.append(ToolCall(obj.name, obj.arguments))
            self._obj = None
        return obj.done

    def _malformed(self, c: str) -> None:
        self.failed, self._raw, self._after_call = True, True, False
        text = "".join(self._region) if self._region is not None else self._ws + c
        self._region, self._obj, self._ws = None, None, ""
        if text:
            self._emit(("content", text))

    # -- driving ----------------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple]:
        for i, c in enumerate(text):
            if self._raw:
                self._emit(("content", text[i:]))
                break
            if self._region is not None:
                self._region.append(c)
            try:
                self._char(c)
            except (ValueError, RecursionError):  # _Malformed, JSON that does not parse
                self._malformed(c)
        return self._take()

    def finish(self) -> list[tuple]:
        if not self._raw:
            hold, self._hold = self._hold, ""
            if self._region is not None:  # a call that never got its name
                self.failed = True
                self._emit(("content", "".join(self._region)))
                self._region = None
            elif self._obj is not None:  # announced, then cut short
                self.failed = True
            else:
                for c in hold:
                    self._content(c)
            if self._ws:
                self._emit(("content", self._ws))
                self._ws = ""
        self._raw = True
        return self._take()

    def _marker(self, c: str, marker: str) -> bool:
        """Matches ``marker`` in content; True once it is complete (held back meanwhile)."""
        h = self._hold + c
        if marker.startswith(h):
            self._hold = "" if h == marker else h
            if h == marker:
                self._begin_call(h)
            return h == marker
        self._hold = ""
        self._content(h[0])
        for ch in h[1:]:  # what follows may still begin one
            if self._marker(ch, marker):
                return True
        return False

    def _char(self, c: str) -> None:
        raise NotImplementedError


class _HermesStream(ToolCallStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after and
    between content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _char(self, c):
        st = self._state
        if st == "text":
            if self._marker(c, self.OPEN):
                self._state = "pre"
        elif st == "pre":
            if c in _WS:
                return
            self._obj, self._state = _CallObject(), "obj"
            self._char(c)
        elif st == "obj":
            if self._obj_char(c):
                self._state = "post"
        else:  # post: whitespace, then the closing tag (or the end of the output)
            if not self._hold and c in _WS:
                return
            h = self._hold + c
            if not self.CLOSE.startswith(h):
                raise _Malformed(f"expected {self.CLOSE}")
            self._hold = h
            if h == self.CLOSE:
                self._hold, self._state, self._after_call = "", "text", True

    def finish(self):
        if self._state == "post":
            self._hold = ""  # a closing tag cut short: the call is whole
        return super().finish()


class _JsonCallsStream(ToolCallStream):
    """JSON call objects one after another, in arrays or not, separated by whitespace, ","
    or ";" (Llama 3 after an optional ``<|python_tag|>``; Mistral after ``[TOOL_CALLS]``;
    the constrained array of ``tool_choice: "required"``)."""

    def __init__(self, state: str = "between") -> None:
        super().__init__()
        self._state = state
        self._in_list = False
        self._expect = "any"  # in an array: "value" (after "[" or ","), "sep" (after a value)

    def _between(self, c: str) -> None:
        if self._in_list:
            if c in _WS:
                return
            if c == "]" and self._expect != "value-strict":
                self._in_list, self._expect = False, "any"
            elif c == "," and self._expect == "sep":
                self._expect = "value-strict"
            elif c == "{" and self._expect != "sep":
                self._start_obj(c)
            else:
                raise _Malformed(f"unexpected {c!r}")
            return
        if c in _WS or c in ",;":
            return
        if c == "[":
            self._in_list, self._expect = True, "value"
        elif c == "{":
            self._start_obj(c)
        else:
            raise _Malformed(f"unexpected {c!r}")

    def _start_obj(self, c: str) -> None:
        if self._region is None:  # (else held since a marker)
            self._begin_call(c)
        self._obj, self._state = _CallObject(), "obj"
        self._obj_char(c)

    def _char(self, c):
        if self._state == "obj":
            if self._obj_char(c):
                self._state = "between"
                if self._in_list:
                    self._expect = "sep"
        else:
            self._between(c)


class _Llama3Stream(_JsonCallsStream):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__("start")

    def _char(self, c):
        st = self._state
        if st == "start":  # a call is the whole message: "{" or the tag first
            if c in _WS:
                self._content(c)
            elif c == "{":
                self._begin_call("")
                self._state = "between"
                self._region.append(c)
                self._between(c)
            elif c == "<":
                self._state = "tag"
                self._hold = c
            else:
                self._raw = True
                self._content(c)
        elif st == "tag":
            h = self._hold + c
            if not self.TAG.startswith(h):
                self._hold = ""
                self._raw = True
                self._emit(("content", self._ws + h))
                self._ws = ""
            elif h == self.TAG:
                self._hold, self._state = "", "between"
                self._begin_call(h)
            else:
                self._hold = h
        else:
            super()._char(c)

    def finish(self):
        if self._state == "tag":
            self._raw = True
            self._emit(("content", self._ws + self._hold))
            self._ws = self._hold = ""
        return super().finish()


class _MistralStream(_JsonCallsStream):
    MARKER = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__("text")

    def _char(self, c):
        if self._state == "text":
            if self._marker(c, self.MARKER):
                self._state = "between"
        else:
            super()._char(c)


class RequiredStream(_JsonCallsStream):
    """The output of ``tool_choice: "required"``: an array of ``{"name", "parameters"}``."""

    def __init__(self) -> None:
        super().__init__()
        self._begin_call("")  # nothing in it is content unless it fails


# ---- parsers of free-form ("auto") output ---------------------------------------------------
class ToolParser:
    """Finds tool calls in the output of one model family: ``stream()`` as it is generated,
    ``parse(text)`` once it is finished (the same reading, all or nothing)."""

    # Whether the format's markers are special tokens that decoding must keep.
    keeps_special_tokens = False

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def call_id(self) -> str:
        """The id of a new call (``call_`` and 24 hex digits, as OpenAI's)."""
        return openai_call_id()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); no calls, or a malformed one: (text, [])."""
        s = self.stream()
        s.feed(text)
        s.finish()
        if s.failed or not s.calls:
            return text, []
        return "".join(s.content) or None, s.calls


class HermesParser(ToolParser):
    def stream(self):
        return _HermesStream()


class Llama3JsonParser(ToolParser):
    def stream(self):
        return _Llama3Stream()


class MistralParser(ToolParser):
    # [TOOL_CALLS] is a control token of Mistral's tokenizers: skipped, the calls would be lost.
    keeps_special_tokens = True

    def stream(self):
        return _MistralStream()

    def call_id(self) -> str:
        return mistral_call_id()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def make_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: one of {sorted(TOOL_PARSERS)}; got {name!r}")
    return TOOL_PARSERS[name]()


# ---- OpenAI chat deltas ----------------------------------------------------------------------
class ToolDeltas:
    """The streamed chat deltas of one choice of a request that may call tools, in OpenAI's
    shape: content as ``content``; each call first as a header ``{"index", "id", "type",
    "function": {"name", "arguments": ""}}``, then ``{"index", "function": {"arguments"}}``
    fragments as the arguments are generated. A named call streams the whole output as its
    arguments; ``"required"`` and ``"auto"`` (through ``parser``) read the calls out of the
    text as it arrives (`ToolCallStream`). ``parallel`` False: the first call only."""

    def __init__(self, mode: str, parser: ToolParser | None = None, parallel: bool = True,
                 new_id=openai_call_id) -> None:
        self.mode, self.new_id = mode, new_id
        self.max_calls = None if parallel else 1
        self.reader: ToolCallStream | None = None
        if mode == "auto":
            self.reader = parser.stream()
        elif mode == "required":
            self.reader = RequiredStream()
        self.num_calls = 0
        self._named_started = False

    def update(self, piece: str, finish: str | None) -> tuple[list[dict], str | None]:
        """The deltas (each one SSE chunk; a call's header and its first fragment are two)
        for ``piece``, the text generated since the last update, and the finish reason."""
        if self.reader is None:  # named
            events = [] if self._named_started else [("call", 0, self.mode)]
            self._named_started = True
            if piece:
                events.append(("args", 0, piece))
            return self._deltas(events), finish
        events = self.reader.feed(piece)
        if finish is not None:
            events += self.reader.finish()
        deltas = self._deltas(events)
        return deltas, "tool_calls" if finish == "stop" and self.num_calls else finish

    def _deltas(self, events: list[tuple]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if ev[0] == "content":
                if not out or "tool_calls" in out[-1]:
                    out.append({})
                out[-1]["content"] = out[-1].get("content", "") + ev[1]
                continue
            kind, i, text = ev
            if self.max_calls is not None and i >= self.max_calls:
                continue
            if kind == "call":
                self.num_calls += 1
                entry = {"index": i, "id": self.new_id(), "type": "function",
                         "function": {"name": text, "arguments": ""}}
            else:
                entry = {"index": i, "function": {"arguments": text}}
            if not out or any(e["index"] == i for e in out[-1].get("tool_calls", ())):
                out.append({})
            out[-1].setdefault("tool_calls", []).append(entry)
        return out
