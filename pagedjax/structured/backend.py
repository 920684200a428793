"""The grammar-library interface behind structured outputs, and the registry of backends.

A backend turns a request's constraint into a compiled grammar (validated, cached per
constraint) and makes one matcher per constrained sequence; a matcher follows the sampled
tokens and writes the allowed next tokens as a packed bitmask row (bit ``t % 32`` of int32
word ``t // 32``). `StructuredOutputs` (manager.py) talks to nothing else, so a library plugs
in by implementing `GrammarBackend` and `GrammarMatcher` and calling `register_backend`.

Built in (`EngineConfig.structured_outputs_config = {"backend": ...}`, as vLLM's flag):
- ``"guidance"`` (llguidance; the default, also what ``"auto"`` picks): every kind of
  constraint, including Lark/GBNF grammars; masks are computed per token from a lazily built
  lexer, so a new schema costs nothing up front.
- ``"outlines"`` (outlines-core): JSON schema, regex and choice compiled to a token-level
  automaton over the whole vocabulary ahead of time; no context-free grammars.

Not built in: ``"xgrammar"``. Its matcher module imports torch at import time (xgrammar
0.2.8), which would pull torch and the CUDA wheels into an engine that has no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from pagedjax.structured.params import GuidedDecodingParams


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32 words)."""

    def consume(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar refuses it (the matcher is then
        unusable: callers stop the sequence)."""

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar accepts, without advancing."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens (at most a draft's length)."""

    def is_stopped(self) -> bool:
        """True when nothing but end-of-sequence can follow: the sequence is complete."""

    def fork(self) -> GrammarMatcher:
        """An independent copy (a fan-out child starts where its parent is)."""

    def error(self) -> str:
        """Why the last `consume` failed (for the log)."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar of ``params``; ValueError naming the field when invalid or
        unsupported by this backend. Cached: the same constraint compiles once."""

    def matcher(self, grammar: Any) -> GrammarMatcher:
        ...

    def fill_batch(self, matchers: Sequence[GrammarMatcher], rows: Sequence[np.ndarray]) -> None:
        """Fill ``rows[i]`` from ``matchers[i]`` (a backend may do it in parallel)."""


class CompileCache:
    """Compiled grammars by constraint (format, text), least recently used dropped first.
    Request threads (servers compile before the engine sees a request) and the engine
    thread share it."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get_or_compile(self, key: tuple[str, str], build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
        value = build()  # outside the lock: a slow compile does not block other requests
        with self._lock:
            self._items[key] = value
            if len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


BackendFactory = Callable[[Any, int], GrammarBackend]  # (tokenizer, vocab_size) -> backend
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` selectable as ``structured_outputs_config={"backend": name}``."""
    _BACKENDS[name] = factory


def backend_names() -> tuple[str, ...]:
    return ("auto", *sorted(_BACKENDS))


def check_backend_name(name: str) -> None:
    if name == "xgrammar":
        raise ValueError("structured_outputs_config.backend: 'xgrammar' is not built in (it "
                         "imports torch); use 'guidance' (the default) or 'outlines'")
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(f"structured_outputs_config.backend: must be one of "
                         f"{backend_names()}; got {name!r}")


def make_backend(name: str, tokenizer, vocab_size: int) -> GrammarBackend:
    """``vocab_size``: the model's logits width (may exceed the tokenizer's: padded
    embeddings); masks cover every logit and padding ids are never allowed."""
    check_backend_name(name)
    return _BACKENDS["guidance" if name == "auto" else name](tokenizer, vocab_size)


def _guidance(tokenizer, vocab_size: int) -> GrammarBackend:
    from pagedjax.structured.guidance import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size)


def _outlines(tokenizer, vocab_size: int) -> GrammarBackend:
    from pagedjax.structured.outlines import OutlinesBackend

    return OutlinesBackend(tokenizer, vocab_size)


register_backend("guidance", _guidance)
register_backend("outlines", _outlines)
