"""Serving errors, shared by the gRPC and HTTP front doors.

The engine raises plain `ValueError`s whose message starts with the bad field's name; this
module turns those (and the async engine's own failures) into one small taxonomy so each front
door maps it to its status codes in one place.
"""

from __future__ import annotations

import re

_UNSUPPORTED_FIELDS = {"use_beam_search", "prompt_logprobs"}
_FIELD_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)")


class ServingError(Exception):
    """Base of all errors a front door reports to its client."""

    kind = "internal"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequestError(ServingError):
    kind = "invalid_argument"


class UnsupportedError(ServingError):
    kind = "unimplemented"


class DuplicateRequestError(ServingError):
    kind = "already_exists"


class UnknownRequestError(ServingError):
    kind = "not_found"


class QueueFullError(ServingError):
    kind = "resource_exhausted"


class NotReadyError(ServingError):
    """The engine is loading, draining or stopped: retry elsewhere or later."""

    kind = "unavailable"


class RequestFailedError(ServingError):
    """One request failed inside the engine; other requests are unaffected."""

    kind = "internal"


# Every `ServingError.kind`, so metrics can export each refusal count before the first one.
REFUSAL_KINDS = tuple(sorted({c.kind for c in (ServingError, InvalidRequestError, UnsupportedError,
                                               DuplicateRequestError, UnknownRequestError,
                                               QueueFullError, NotReadyError,
                                               RequestFailedError)}))


def field_of(message: str) -> str | None:
    """The field a validation message names (engine messages start with it)."""
    if message.lower().startswith("unknown sampling parameter"):
        rest = message.split(":", 1)[-1]
        m = _FIELD_RE.match(rest)
        return m.group(1) if m else None
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def from_value_error(exc: ValueError) -> ServingError:
    """Classify an engine/SamplingParams `ValueError`.

    "field: ..." about an unsupported feature is UNIMPLEMENTED; a value out of range
    ("prompt_logprobs must be ... got -5", SamplingParams' form) is the client's mistake
    whatever the field, so INVALID_ARGUMENT."""
    msg = str(exc)
    field = field_of(msg)
    if field in _UNSUPPORTED_FIELDS and msg.startswith(f"{field}:"):
        return UnsupportedError(msg, field)
    return InvalidRequestError(msg, field)
