"""N-gram (prompt lookup) proposer: drafts copied from the sequence's own history.

Input-grounded generation (summarising or editing a given text, code completion that repeats
identifiers) continues spans that already occur in the prompt or output. For the sequence's
last ``n`` tokens, from ``max_n`` down to ``min_n``, the proposer finds the latest earlier
position where the same ``n`` tokens occur and proposes the up to ``k`` tokens that followed
them. Longer matches first: they predict better; the latest occurrence: the most recent
context wins in repetitive output. No model runs, so a proposal costs only host time:
one vectorised comparison per ``n`` over the history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        if k < 1 or min_n < 1 or max_n < min_n:
            raise ValueError("need k >= 1 and 1 <= min_n <= max_n")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose_for(self, seq, k: int) -> list[int]:
        """The scheduler's interface: drafts for a `Sequence`."""
        return self.propose(seq.get_token_slice(0, seq.num_total_tokens), k)

    def propose(self, tokens: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the proposer's) draft tokens to follow ``tokens``; [] when
        no suffix of length ``min_n..max_n`` occurs earlier. The scheduler asks for ``k + 1``
        when the first token stands for one still on the device (`Scheduler._propose`)."""
        k = self.k if k is None else k
        if k <= 0:
            return []
        a = np.asarray(tokens)
        length = a.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Start positions i < length - n whose n tokens equal the suffix.
            starts = length - n
            match = np.ones(starts, bool)
            for j in range(n):
                match &= a[j : j + starts] == a[length - n + j]
            hits = np.flatnonzero(match)
            if hits.size:
                i = int(hits[-1]) + n  # first token after the latest earlier occurrence
                return a[i : i + k].tolist()
        return []
