"""The engine's structured-output state: one grammar matcher per constrained sequence,
advanced as tokens are applied, and the token bitmask rows the sampler applies on the
device (`pagedjax.sampler`: tokens outside the mask get -inf before sampling).

A matcher follows its sequence's output tokens only, so preemption (recompute or swap)
needs nothing; a fan-out child copies its parent's matcher before the parent's token of
that step is consumed; a sequence whose grammar is complete stops ("stop"). Masks depend on
the last token, so a step with constrained rows is awaited before the next is scheduled
under async scheduling. Speculative drafts are scored under the masks their prefixes give
(`fill_rows`), so a draft the grammar refuses is always rejected. The grammar library is a
`GrammarBackend` (backend.py), picked by `EngineConfig.structured_outputs_config`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from pagedjax.structured.backend import GrammarBackend, GrammarMatcher, make_backend
from pagedjax.structured.params import GuidedDecodingParams

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, backend: str = "auto") -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._matchers: dict[int, GrammarMatcher] = {}

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:  # servers compile on their request threads too
            if self._backend is None:  # the library and tokenizer tables load on first use
                if self._tokenizer is None:
                    raise ValueError("guided_decoding: this engine has no tokenizer")
                self._backend = make_backend(self.backend_name, self._tokenizer,
                                             self.vocab_size)
            return self._backend

    @property
    def mask_width(self) -> int:
        return -(-self.vocab_size // 32)

    def compile(self, params: GuidedDecodingParams):
        return self.backend.compile(params)

    def _matcher(self, seq_id: int, grammar) -> GrammarMatcher:
        m = self._matchers.get(seq_id)
        if m is None:
            m = self._matchers[seq_id] = self.backend.matcher(grammar)
        return m

    def fill_rows(self, wanted: Sequence[tuple[int, object, Sequence[int]]]) -> list[np.ndarray]:
        """The mask rows of a step: for each (seq_id, grammar, drafts), an int32 array of
        ``1 + len(drafts)`` rows. Row 0 is the matcher's current state; with speculative
        drafts, row j is the state after drafts[:j] (consumed, then rolled back). Rows after
        a draft the grammar refuses allow everything: that draft is rejected (the row before
        it cannot sample it), so they are never used. Undrafted rows are filled in one batch
        (a backend may fill them in parallel)."""
        out: list[np.ndarray] = []
        plain: list[GrammarMatcher] = []
        plain_at: dict[int, list[int]] = {}  # seq_id -> entries: a fresh prompt's n samples
        for i, (seq_id, grammar, drafts) in enumerate(wanted):  # share its one sequence
            m = self._matcher(seq_id, grammar)
            rows = np.empty((1 + len(drafts), self.mask_width), np.int32)
            out.append(rows)
            if not drafts:
                if seq_id not in plain_at:
                    plain.append(m)
                    plain_at[seq_id] = []
                plain_at[seq_id].append(i)
                continue
            m.fill(rows[0])
            # Only drafts known valid are consumed: a refused token puts a matcher in an
            # error state that rollback does not undo.
            valid = m.validate(drafts)
            taken = 0
            for j in range(1, len(rows)):
                if j - 1 < valid and not m.is_stopped() and m.consume(drafts[j - 1]):
                    taken += 1
                    m.fill(rows[j])
                else:
                    rows[j:].fill(-1)
                    break
            m.rollback(taken)
        if plain:
            block = np.empty((len(plain), self.mask_width), np.int32)
            self.backend.fill_batch(plain, block)
            for k, entries in enumerate(plain_at.values()):
                for i in entries:
                    out[i][0] = block[k]
        return out

    def fork(self, parent_id: int, child_id: int, grammar) -> None:
        m = self._matchers.get(parent_id)
        self._matchers[child_id] = m.fork() if m is not None else self.backend.matcher(grammar)

    def advance(self, seq_id: int, grammar, token_id: int) -> bool:
        """Consume one sampled token; True when the sequence must stop (its grammar is
        complete, or the token was not allowed, which masking rules out)."""
        m = self._matcher(seq_id, grammar)
        if not m.consume(token_id):
            logger.warning("sequence %d: token %d refused by its grammar (%s); stopping it",
                           seq_id, token_id, m.error())
            return True
        return m.is_stopped()

    def retain(self, live: set[int]) -> None:
        """Drop the matchers of sequences not in ``live`` (finished, aborted, failed)."""
        for sid in [sid for sid in self._matchers if sid not in live]:
            del self._matchers[sid]

    def __len__(self) -> int:
        return len(self._matchers)
