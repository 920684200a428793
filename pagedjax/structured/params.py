"""What a request constrains its output to (vLLM's ``GuidedDecodingParams``), validated
eagerly with errors naming the field; no grammar library is imported here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# One schema or grammar per request is compiled and kept; bound its size like stop strings.
MAX_GUIDE_CHARS = 65536
MAX_CHOICES = 1024


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one of: ``json`` (a JSON schema, dict or JSON text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (Lark or GBNF/EBNF text), or
    ``json_object=True`` (any JSON object, OpenAI's ``response_format: json_object``)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided_decoding: exactly one of {', '.join(_KINDS)} must be "
                             f"set, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"guided_decoding.json: not valid JSON ({e})") from None
            if not isinstance(value, dict | bool):
                raise ValueError("guided_decoding.json: a JSON schema must be an object")
            text = json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list | tuple) or not value or not all(
                    isinstance(c, str) and c for c in value):
                raise ValueError("guided_decoding.choice: must be a non-empty list of "
                                 "non-empty strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"guided_decoding.choice: at most {MAX_CHOICES} choices")
            object.__setattr__(self, "choice", tuple(value))
            text = json.dumps(list(value))
        elif kind == "json_object":
            if value is not True:
                raise ValueError("guided_decoding.json_object: must be true")
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"guided_decoding.{kind}: must be a non-empty string")
            text = value
        if len(text) > MAX_GUIDE_CHARS:
            raise ValueError(f"guided_decoding.{kind}: at most {MAX_GUIDE_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def source(self) -> tuple[str, str]:
        """(llguidance grammar format, text): the cache key of the compiled grammar."""
        kind = self.kind
        if kind == "json":
            schema = self.json if not isinstance(self.json, str) else json.loads(self.json)
            return "json_schema", json.dumps(schema)  # property order guides the output
        if kind == "json_object":
            return "json_schema", '{"type": "object"}'
        if kind == "choice":
            return "choice", json.dumps(list(self.choice))
        if kind == "regex":
            return "regex", self.regex
        return "grammar", self.grammar

    @classmethod
    def coerce(cls, value: Any) -> GuidedDecodingParams | None:
        """None, an instance, or a dict of its fields (the JSON/gRPC form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_KINDS))
            if unknown:
                raise ValueError(f"guided_decoding: unknown field(s) {', '.join(unknown)}")
            return cls(**value)
        raise ValueError(f"guided_decoding: must be a dict or GuidedDecodingParams, got "
                         f"{type(value).__name__}")
