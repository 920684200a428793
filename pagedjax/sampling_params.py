"""Per-request sampling parameters (host side, no JAX import).

Mirrors vLLM's ``SamplingParams`` surface so OpenAI-style requests map onto it
1:1, but validates eagerly: every bad value raises ``ValueError`` naming the
offending field, so the API layer can return a 400 with a useful message
instead of failing inside a jitted step.

Beam search (legacy vLLM style): ``use_beam_search=True`` with beam width
``best_of`` (defaults to ``n``); the width must be > 1, sampling must be greedy
(``temperature=0``) with no top-k/top-p/min-p filtering. The ``n`` best finished
beams are returned. ``length_penalty`` divides the cumulative logprob by
``seq_len ** length_penalty`` and ``early_stopping`` selects the stopping rule
(``True``: stop as soon as ``best_of`` beams finished; ``False``: stop when no
live beam can still beat the worst finished one at its current length;
``"never"``: the canonical rule, assume the beam could grow to ``max_tokens``).
See :mod:`pagedjax.beam_search`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Literal

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# Bounds on what one request may ask the engine to check every step: stop strings are matched
# against each new piece of text, so 200k of them slowed every other stream 3x.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Token ids travel to the device as int32 (the sampler's ban lists): a larger id would fail the
# whole engine step (every request in the batch), not just this one.
MAX_TOKEN_ID = 2**31 - 1
# logit_bias entries per request: bounded like the stop lists, since the sampler carries them
# at a fixed width in every batch that has any.
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "length_penalty")


@dataclass(repr=False)
class SamplingParams:
    """Sampling configuration of one request; validated on construction."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    include_stop_str_in_output: bool = False
    # Structured outputs (`pagedjax.structured`): a GuidedDecodingParams or its dict form.
    guided_decoding: Any = None
    # Added to the logits of these token ids (OpenAI's logit_bias: values in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: the last token of each is banned where the output ends with the
    # tokens before it (vLLM's rule; the engine tokenizes them with and without a leading space).
    bad_words: list[str] | None = None
    # Normalised copies (not constructor arguments).
    _stop_list: list[str] = field(init=False, default_factory=list)
    _stops: tuple[str, ...] = field(init=False, default=())
    _longest_stop: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # Normalise containers first so validation sees one shape.
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self._stop_list = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                                 f"{self.logit_bias!r}.")
            try:  # OpenAI's JSON keys are strings
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias keys must be token ids (integers).") from None
        for name in ("allowed_token_ids", "bad_words"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, list | tuple):
                raise ValueError(f"{name} must be a list, got {v!r}.")
            if v is not None:
                setattr(self, name, list(v))
        if self.top_k == 0:  # OpenAI clients send 0 for "disabled".
            self.top_k = -1
        if self.best_of is None:
            self.best_of = self.n
        from pagedjax.structured.params import GuidedDecodingParams

        self.guided_decoding = GuidedDecodingParams.coerce(self.guided_decoding)
        self._validate()

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        # Real, finite numbers first: inf would pass the range checks below (inf >= 0) and
        # turn into NaN logits on the device; a string would make them raise TypeError.
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            need(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
                 name, "must be a finite number")

        need(is_int(self.n) and self.n >= 1, "n", "must be an int >= 1")
        need(is_int(self.best_of) and self.best_of >= self.n, "best_of", "must be an int >= n")
        need(self.temperature >= 0.0, "temperature", "must be non-negative")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1 (disable), 0 or >= 1")
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "must be an int or None")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be >= 1")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        need(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        need(all(isinstance(s, str) and s for s in self._stop_list), "stop",
             "must be a non-empty string or a list of non-empty strings")
        need(len(self._stop_list) <= MAX_STOP_STRINGS, "stop",
             f"must have at most {MAX_STOP_STRINGS} strings")
        need(all(len(s) <= MAX_STOP_STRING_CHARS for s in self._stop_list), "stop",
             f"strings must have at most {MAX_STOP_STRING_CHARS} characters")
        self._stops = tuple(self._stop_list)
        self._longest_stop = max(map(len, self._stops), default=0)
        need(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"must have at most {MAX_STOP_TOKEN_IDS} ids")
        need(all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids), "stop_token_ids",
             f"must be ints in [0, {MAX_TOKEN_ID}]")
        if self.logit_bias:
            need(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                 f"must have at most {MAX_LOGIT_BIAS} entries")
            need(all(0 <= t <= MAX_TOKEN_ID for t in self.logit_bias), "logit_bias",
                 f"keys must be token ids in [0, {MAX_TOKEN_ID}]")
            need(all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
                     and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
                 "values must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            need(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")
            need(all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.allowed_token_ids),
                 "allowed_token_ids", f"must be ints in [0, {MAX_TOKEN_ID}]")
        if self.bad_words is not None:
            need(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words",
                 f"must have at most {MAX_BAD_WORDS} words")
            need(all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS
                     for w in self.bad_words), "bad_words",
                 f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
                 f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(self.early_stopping in (True, False, "never"), "early_stopping",
             "must be True, False or 'never'")
        if self.use_beam_search:
            need(self.guided_decoding is None, "guided_decoding",
                 "is not supported with use_beam_search=True")
            need(self.best_of > 1, "best_of", "must be > 1 when using beam search")
            need(self.temperature < _GREEDY_EPS, "temperature",
                 "must be 0 when using beam search")
            need(self.top_p == 1.0, "top_p", "must be 1 when using beam search")
            need(self.top_k == -1, "top_k", "must be -1 when using beam search")
            need(self.min_p == 0.0, "min_p", "must be 0 when using beam search")
        else:
            need(self.length_penalty == 1.0, "length_penalty",
                 "is only supported with use_beam_search=True")
            need(self.early_stopping is False, "early_stopping",
                 "is only supported with use_beam_search=True")
            if self.temperature < _GREEDY_EPS:
                # n identical greedy samples would waste compute silently.
                need(self.best_of == 1, "best_of", "must be 1 for greedy sampling")

    # -------------------------------------------------------------- factories
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a request dict; unknown keys are errors, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}.")
        return cls(**d)

    # ------------------------------------------------------------- properties
    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalised to a list."""
        return list(self._stop_list)

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop_list)  # no copy: asked for every token of every step

    @property
    def stops(self) -> tuple[str, ...]:
        """`stop_strings` without the copy, for the stop-string search of every token."""
        return self._stops

    @property
    def longest_stop(self) -> int:
        """Characters in the longest stop string (0: none): how far back into earlier text a
        stop string can start. Worked out once (`__post_init__`), as it is read for every
        token of a stream with stop strings."""
        return self._longest_stop

    @property
    def is_greedy(self) -> bool:
        # Tiny temperatures blow up logits / T in fp32; treat them as argmax.
        return self.temperature < _GREEDY_EPS

    @property
    def beam_width(self) -> int:
        return int(self.best_of) if self.use_beam_search else 1

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: Any) -> SamplingParams:
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        kw.update(changes)
        return SamplingParams(**kw)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.init
        )
        return f"SamplingParams({parts})"
