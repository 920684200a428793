"""Pydantic schemas of the OpenAI-compatible API (the subset we serve) and their sampling params.

Nothing is silently dropped: a field this server does not know is a 400 naming it, and the few
that are accepted without effect are listed in `IGNORED_FIELDS` (and documented in the API
schema). Every value that is used is validated by `SamplingParams`, whose errors name the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, field_validator, model_validator

from pagedjax.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID
from pagedjax.serving.tools import check_tools

# Roles the chat template may see. Anything else is refused: a role is pasted into the
# template verbatim, so "user<|im_end|>\n<|im_start|>system" would let a user write a system
# turn.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_unicode(value: Any) -> Any:
    """Refuse strings that are not valid Unicode text (JSON can carry a lone UTF-16
    surrogate such as "\\ud800", which the tokenizer cannot encode)."""
    parts = value if isinstance(value, list) else [value]
    for part in parts:
        if isinstance(part, dict):
            part = part.get("text")
        if isinstance(part, str):
            try:
                part.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid Unicode text (unpaired surrogate at character "
                                 f"{e.start})") from None
    return value


def _bounds(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema states `SamplingParams`' bounds. Documentation only: the
    values are still validated by `SamplingParams` (its messages name the field), but clients
    and schema-driven fuzzers see what is accepted instead of a bare number."""
    return Field(default=default, json_schema_extra=schema)


_LOGPROBS = dict(minimum=0, maximum=MAX_LOGPROBS)


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Accepted and ignored: bookkeeping fields of OpenAI's API that change nothing about the
# generated text.
IGNORED_FIELDS = ("user", "service_tier", "store", "metadata")
_IGNORED = Field(default=None, description="accepted and ignored (no effect on generation)")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("json_schema.schema is required when type is 'json_schema'")
        return self


class _Sampling(_Base):
    """Fields shared by completions and chat, including vLLM's extra sampling options."""

    model: str | None = None
    n: int = _bounds(1, minimum=1)
    best_of: int | None = _bounds(minimum=1)
    temperature: float | None = _bounds(minimum=0)
    top_p: float | None = _bounds(exclusiveMinimum=0, maximum=1)
    seed: int | None = None
    stop: str | list[str] | None = _bounds(maxItems=MAX_STOP_STRINGS)
    presence_penalty: float | None = _bounds(minimum=-2, maximum=2)
    frequency_penalty: float | None = _bounds(minimum=-2, maximum=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = _IGNORED
    service_tier: str | None = _IGNORED
    store: bool | None = _IGNORED
    metadata: dict[str, str] | None = _IGNORED
    logit_bias: dict[str, float] | None = None
    # vLLM extras: token-level rules
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM extras
    top_k: int | None = _bounds(minimum=-1)
    min_p: float | None = _bounds(minimum=0, maximum=1)
    repetition_penalty: float | None = _bounds(exclusiveMinimum=0)
    min_tokens: int | None = _bounds(minimum=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = _bounds(maxItems=MAX_STOP_TOKEN_IDS,
                                               items={"type": "integer", "minimum": 0,
                                                      "maximum": MAX_TOKEN_ID})
    skip_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = _bounds(**_LOGPROBS)
    # Structured outputs: OpenAI's response_format and vLLM's guided_* extras.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Labels the response only (engine ids are the server's own): bounded, one printable line.
    request_id: str | None = Field(default=None, max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")
    # vLLM's: with `--scheduling-policy priority`, lower runs first; any other policy takes 0.
    priority: StrictInt = Field(default=0, ge=-(2**63), le=2**63 - 1)

    def common_params(self) -> dict[str, Any]:
        keys = ("n", "best_of", "temperature", "top_p", "seed", "stop", "presence_penalty",
                "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                "stop_token_ids", "skip_special_tokens", "use_beam_search", "length_penalty",
                "early_stopping", "include_stop_str_in_output", "prompt_logprobs",
                "logit_bias", "allowed_token_ids", "bad_words")
        d = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        guide = self.guided_decoding()
        if guide is not None:
            d["guided_decoding"] = guide
        return d

    def guided_decoding(self) -> dict[str, Any] | None:
        """`GuidedDecodingParams` fields from response_format / guided_*; more than one
        constraint is refused (by `GuidedDecodingParams`, naming them)."""
        guide = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                   ("choice", self.guided_choice),
                                   ("grammar", self.guided_grammar)) if v is not None}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            guide["json_object"] = True
        elif rf is not None and rf.type == "json_schema":
            guide["response_format"] = rf.json_schema.schema_
        if len(guide) > 1:
            names = ["response_format" if k in ("json_object", "response_format")
                     else f"guided_{k}" for k in guide]
            raise ValueError(f"at most one of response_format and guided_* may constrain the "
                             f"output; got {', '.join(names)}")
        if "response_format" in guide:
            guide["json"] = guide.pop("response_format")
        return guide or None

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        self.guided_decoding()
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]

    _prompt_text = field_validator("prompt")(check_unicode)
    max_tokens: int | None = _bounds(16, minimum=1)
    logprobs: int | None = _bounds(**_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> dict[str, Any]:
        d = self.common_params()
        if self.max_tokens is not None:
            d["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d


class ChatMessage(_Base):
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: which call it answers

    _content_text = field_validator("content")(check_unicode)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only text parts are supported (got "
                                     f"{kind!r}); this server serves text-only models")
        return content

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}")
        return role


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # Tool calling (`pagedjax.serving.tools`); the legacy `functions` API is refused by name.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    _funcs: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _mode: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        if self.functions is not None or self.function_call is not None:
            field = "functions" if self.functions is not None else "function_call"
            raise ValueError(f"{field}: the legacy functions API is not served; use tools")
        funcs, mode = check_tools(self.tools, self.tool_choice)
        if mode not in (None, "auto") and self.guided_decoding() is not None:
            raise ValueError("tool_choice: a required or named tool call cannot be combined "
                             "with response_format or guided_*")
        self._funcs, self._mode = funcs, mode
        return self

    def tool_mode(self) -> tuple[list[dict], str | None]:
        """(functions, mode): mode None (no tool calls), "auto", "required" or a name."""
        return self._funcs, self._mode
    max_tokens: int | None = _bounds(minimum=1)
    max_completion_tokens: int | None = _bounds(minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _bounds(**_LOGPROBS)

    def sampling_params(self) -> dict[str, Any]:
        d = self.common_params()
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if mt is not None:
            d["max_tokens"] = mt
        if self.logprobs:
            d["logprobs"] = self.top_logprobs or 0
        return d

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (text parts joined)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:  # templates take the arguments as an object, OpenAI sends JSON text
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    f = dict(call.get("function") or {})
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": f}


class TokenizeRequest(_Base):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template (with
    ``tools`` shown to it, as a chat request would)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    _prompt_text = field_validator("prompt")(check_unicode)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0,
                                                            "maximum": MAX_TOKEN_ID}})
