"""The grammar library behind structured outputs: llguidance.

Why llguidance rather than xgrammar (both are vLLM backends): llguidance is one
dependency-free wheel, while xgrammar 0.2.8 pulls torch 2.14 and the CUDA 13 wheels into an
engine that has no torch; and llguidance has no ahead-of-time grammar compile: masks are
computed per token from a lazily built lexer (tens of microseconds), so a new schema costs a
request nothing up front. The backend is one small class: another library plugs in by
providing `compile`, `matcher` and the matcher calls `StructuredOutputs` makes
(`consume_token`, `is_stopped`, `deep_copy`, mask filling).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from pagedjax.structured.params import GuidedDecodingParams


class GuidanceBackend:
    CACHE_SIZE = 256  # compiled grammars kept, by (format, text)

    def __init__(self, tokenizer, vocab_size: int) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's: padded
        embeddings), so masks cover every logit and padding ids are never allowed."""
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask_width = math.ceil(vocab_size / 32)  # int32 words per row
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # compiles come from request threads and the engine

    def compile(self, params: GuidedDecodingParams) -> str:
        """The grammar for ``params``, validated against the tokenizer; an invalid schema,
        regex or grammar raises ValueError naming the field."""
        key = params.source()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        fmt, text = key
        try:
            grammar = self._ll.grammar_from(fmt, text)
        except ValueError as e:
            raise ValueError(f"guided_decoding.{params.kind}: {e}") from None
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"guided_decoding.{params.kind}: {error.strip()}")
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str):
        m = self._ll.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"guided_decoding: {m.get_error()}")
        return m

    @staticmethod
    def fill(matcher, row: np.ndarray) -> None:
        """Write the matcher's allowed next tokens into ``row`` (int32 words, bit t % 32 of
        word t // 32 set: allowed)."""
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
