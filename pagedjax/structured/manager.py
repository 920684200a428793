"""The engine's structured-output state: one grammar matcher per constrained sequence,
advanced as tokens are applied, and the token bitmask rows the sampler applies on the
device (`pagedjax.sampler`: tokens outside the mask get -inf before sampling).

A matcher follows its sequence's output tokens only, so preemption (recompute or swap)
needs nothing; a fan-out child copies its parent's matcher before the parent's token of
that step is consumed; a sequence whose grammar is complete stops ("stop"). Masks depend on
the last token, so a step with constrained rows is awaited before the next is scheduled
under async scheduling. Speculative drafts are scored under the masks their prefixes give
(`fill_drafts`), so a draft the grammar refuses is always rejected.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from pagedjax.structured.params import GuidedDecodingParams

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend = None
        self._lock = threading.Lock()
        self._matchers: dict[int, object] = {}

    @property
    def backend(self):
        with self._lock:  # servers compile on their request threads too
            if self._backend is None:  # the library and tokenizer tables load on first use
                if self._tokenizer is None:
                    raise ValueError("guided_decoding: this engine has no tokenizer")
                from pagedjax.structured.backend import GuidanceBackend

                self._backend = GuidanceBackend(self._tokenizer, self.vocab_size)
            return self._backend

    @property
    def mask_width(self) -> int:
        return -(-self.vocab_size // 32)

    def compile(self, params: GuidedDecodingParams) -> str:
        return self.backend.compile(params)

    def fill(self, seq_id: int, grammar: str, row: np.ndarray) -> None:
        m = self._matchers.get(seq_id)
        if m is None:
            m = self._matchers[seq_id] = self.backend.matcher(grammar)
        self.backend.fill(m, row)

    def fill_drafts(self, seq_id: int, grammar: str, drafts, rows: list[np.ndarray]) -> None:
        """Masks of a drafted sequence's rows (speculative decoding): row 0 from the current
        state, row j after drafts[:j], consumed and rolled back. Rows after a draft the
        grammar refuses allow everything: that draft is rejected (the row before it cannot
        sample it), so they are never used."""
        m = self._matchers.get(seq_id)
        if m is None:
            m = self._matchers[seq_id] = self.backend.matcher(grammar)
        self.backend.fill(m, rows[0])
        # Only drafts known valid are consumed: a refused token puts a matcher in an error
        # state that rollback does not undo.
        valid = m.validate_tokens(list(drafts))
        taken = 0
        for j, row in enumerate(rows[1:]):
            if j < valid and not m.is_stopped() and m.consume_token(drafts[j]):
                taken += 1
                self.backend.fill(m, row)
            else:
                row.fill(-1)
        if taken:
            m.rollback(taken)

    def fork(self, parent_id: int, child_id: int, grammar: str) -> None:
        m = self._matchers.get(parent_id)
        self._matchers[child_id] = (m.deep_copy() if m is not None
                                    else self.backend.matcher(grammar))

    def advance(self, seq_id: int, grammar: str, token_id: int) -> bool:
        """Consume one sampled token; True when the sequence must stop (its grammar is
        complete, or the token was not allowed, which masking rules out)."""
        m = self._matchers.get(seq_id)
        if m is None:
            m = self._matchers[seq_id] = self.backend.matcher(grammar)
        if not m.consume_token(token_id):
            logger.warning("sequence %d: token %d refused by its grammar (%s); stopping it",
                           seq_id, token_id, m.get_error())
            return True
        return m.is_stopped()

    def retain(self, live: set[int]) -> None:
        """Drop the matchers of sequences not in ``live`` (finished, aborted, failed)."""
        for sid in [sid for sid in self._matchers if sid not in live]:
            del self._matchers[sid]

    def __len__(self) -> int:
        return len(self._matchers)
