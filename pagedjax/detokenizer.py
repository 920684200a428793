"""Incremental detokenization: decode only a short window of new tokens each step.

Byte-level BPE tokens can split a UTF-8 character; text is released only once the window
decodes without a trailing replacement character, so streamed deltas never show half a
character and their concatenation equals decoding all tokens at once.

Per step and sequence the work is O(window), never O(output length): the windows are sliced
from the sequence (`Sequence.get_token_slice`), and `Detokenizer.step` decodes the windows of
every sequence that got a token in one call into the Rust tokenizer (`decode_batch`), instead
of two Python-level `decode` calls per sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


@dataclasses.dataclass
class DetokState:
    text: str = ""
    prefix_offset: int = 0  # tokens before this are fully released context
    read_offset: int = 0  # tokens before this have been turned into `text`


# (start, end) -> token ids of that range of a sequence, e.g. `Sequence.get_token_slice`.
Slicer = Callable[[int, int], list[int]]


def _release(prefix: str, full: str, state: DetokState, total: int) -> str:
    if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
        delta = full[len(prefix):]
        state.text += delta
        state.prefix_offset = state.read_offset
        state.read_offset = total
        return delta
    return ""


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokState,
                             skip_special_tokens: bool) -> str:
    """Append newly decodable text to `state.text`; returns the delta."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    return _release(prefix, full, state, len(token_ids))


def flush(tokenizer, token_ids: list[int], state: DetokState, skip_special_tokens: bool) -> str:
    """At the end of a sequence release whatever is left (even a dangling partial char)."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    delta = full[len(prefix) :] if len(full) > len(prefix) else ""
    state.text += delta
    state.prefix_offset = state.read_offset = len(token_ids)
    return delta


class Detokenizer:
    """Batched incremental detokenization over a tokenizer.

    Uses the fast tokenizer's Rust `decode_batch` when decoding through it gives exactly what
    `tokenizer.decode` gives (no Python-side clean-up of tokenization spaces); any other
    tokenizer (tests use plain objects with `decode`) is decoded one window at a time.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        clean = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._batch = backend.decode_batch if backend is not None and not clean else None

    def _decode_many(self, windows: list[list[int]], skip: bool) -> list[str]:
        if self._batch is not None:
            return self._batch(windows, skip_special_tokens=skip)
        return [self.tokenizer.decode(w, skip_special_tokens=skip) for w in windows]

    def step(self, items: Sequence[tuple[Slicer, int, DetokState, bool]]) -> list[str]:
        """One incremental step for each ``(slice_fn, num_tokens, state, skip_special)``;
        returns each item's released delta."""
        deltas = [""] * len(items)
        for skip in (False, True):
            idx = [i for i, it in enumerate(items) if it[3] == skip]
            if not idx:
                continue
            windows = []
            for i in idx:
                get, total, st, _ = items[i]
                windows.append(get(st.prefix_offset, st.read_offset))
                windows.append(get(st.prefix_offset, total))
            texts = self._decode_many(windows, skip)
            for k, i in enumerate(idx):
                _, total, st, _ = items[i]
                deltas[i] = _release(texts[2 * k], texts[2 * k + 1], st, total)
        return deltas

    def flush(self, get: Slicer, total: int, state: DetokState, skip: bool) -> str:
        """Release whatever is left at the end of a sequence (even a dangling partial char)."""
        prefix, full = self._decode_many([get(state.prefix_offset, state.read_offset),
                                          get(state.prefix_offset, total)], skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        state.text += delta
        state.prefix_offset = state.read_offset = total
        return delta
