"""The llguidance backend (the default; `backend.py` says why).

Why llguidance rather than xgrammar (both are vLLM backends): llguidance is one
dependency-free wheel, while xgrammar 0.2.8 pulls torch 2.14 and the CUDA 13 wheels into an
engine that has no torch; and llguidance has no ahead-of-time grammar compile: masks are
computed per token from a lazily built lexer (tens of microseconds), so a new schema costs a
request nothing up front. Batches of rows are filled by llguidance's own thread pool
(`LLExecutor`), outside the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pagedjax.structured.backend import CompileCache
from pagedjax.structured.params import GuidedDecodingParams

# Rows filled one by one below this many (a thread pool's hand-off costs more than a mask).
PARALLEL_FILL_ROWS = 8


class GuidanceMatcher:
    __slots__ = ("m",)

    def __init__(self, m) -> None:
        self.m = m

    def fill(self, row: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def consume(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id))

    def validate(self, token_ids: Sequence[int]) -> int:
        return int(self.m.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def is_stopped(self) -> bool:
        return bool(self.m.is_stopped())

    def fork(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.m.deep_copy())

    def error(self) -> str:
        return self.m.get_error()


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask_width = math.ceil(vocab_size / 32)  # int32 words per row
        self.cache = CompileCache()
        self._executor = None

    def compile(self, params: GuidedDecodingParams) -> str:
        """The grammar for ``params``, validated against the tokenizer; an invalid schema,
        regex or grammar raises ValueError naming the field."""
        return self.cache.get_or_compile(params.source(), lambda: self._compile(params))

    def _compile(self, params: GuidedDecodingParams) -> str:
        fmt, text = params.source()
        try:
            grammar = self._ll.grammar_from(fmt, text)
        except ValueError as e:
            raise ValueError(f"guided_decoding.{params.kind}: {e}") from None
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"guided_decoding.{params.kind}: {error.strip()}")
        return grammar

    def matcher(self, grammar: str) -> GuidanceMatcher:
        m = self._ll.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"guided_decoding: {m.get_error()}")
        return GuidanceMatcher(m)

    def fill_batch(self, matchers: Sequence[GuidanceMatcher], rows: np.ndarray) -> None:
        """``rows``: one C-contiguous int32 array [len(matchers), mask_width]."""
        if len(matchers) < PARALLEL_FILL_ROWS:
            for m, row in zip(matchers, rows, strict=True):
                m.fill(row)
            return
        if self._executor is None:
            self._executor = self._ll.LLExecutor()
        assert rows.flags.c_contiguous and rows.dtype == np.int32
        self._executor.unsafe_compute_mask_ptr(
            [(m.m, i) for i, m in enumerate(matchers)], rows.ctypes.data,
            rows.shape[1] * rows.itemsize, rows.shape[0])
