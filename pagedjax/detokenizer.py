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

import json
import logging
import weakref
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class DetokState:
    """A sequence's released text and where its decoding stands.

    The text is kept in pieces: a ``str`` attribute grown with ``+=`` is copied whole on
    every append (CPython only extends a string in place through a local name), which made
    each step's work per sequence grow with its output (0.13 us at 1k characters, 2.4 us at
    120k). New text goes to a short tail (under `TAIL` characters, so copying it is cheap:
    0.1 us per append against 0.28 for merging pieces every time); a full tail becomes a
    piece of its own, never merged, so no append copies more than the tail. (Pieces used to
    merge while the newest was at least half the one before: O(log n) of them, but a merge
    cascade copied up to the whole text in one step, and sequences decoding in step all
    cascaded in the same one: 256 of them reaching 7k characters took 0.15-0.6 ms on 12-13
    steps in 1600, against a median of 0.03 ms; `bench/detok_append.py`.) A piece per 256
    characters is ~20 % over the text's own bytes. The tail a stop-string search or a delta
    output reads is sliced from the last few pieces; `text` joins them all (a cumulative
    output's cost anyway) and keeps the result as one piece.
    """

    __slots__ = ("_parts", "_tail", "length", "prefix_offset", "read_offset")
    TAIL = 256

    def __init__(self, text: str = "", prefix_offset: int = 0, read_offset: int = 0) -> None:
        self._parts: list[str] = [text] if text else []
        self._tail = ""  # the newest text, not yet a piece
        self.length = len(text)  # characters released so far
        self.prefix_offset = prefix_offset  # tokens before this are fully released context
        self.read_offset = read_offset  # tokens before this have been turned into text

    def append(self, piece: str) -> None:
        # `OutputProcessor.stream_rows` inlines this for its steady rows: change both.
        tail = self._tail + piece
        self.length += len(piece)
        if len(tail) < self.TAIL:
            self._tail = tail
            return
        self._tail = ""
        self._parts.append(tail)

    def release(self, piece: str, total: int) -> None:
        """`append` the text of the tokens up to ``total``, which ends on a character
        boundary: the released context moves up to them."""
        self.append(piece)
        self.prefix_offset = self.read_offset
        self.read_offset = total

    @property
    def text(self) -> str:
        if self._tail:
            self._parts.append(self._tail)
            self._tail = ""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._parts = [value] if value else []
        self._tail = ""
        self.length = len(value)

    def tail(self, start: int) -> str:
        """``text[start:]``, reading only the pieces it spans."""
        need = self.length - max(0, start)
        if need <= 0:
            return ""
        got = len(self._tail)
        if got >= need:
            return self._tail[got - need:]
        i = len(self._parts)
        while got < need:
            i -= 1
            got += len(self._parts[i])
        return "".join(self._parts[i:] + [self._tail])[got - need:]

    def __repr__(self) -> str:
        return (f"DetokState(text={self.text!r}, prefix_offset={self.prefix_offset}, "
                f"read_offset={self.read_offset})")


# (start, end) -> token ids of that range of a sequence, e.g. `Sequence.get_token_slice`.
Slicer = Callable[[int, int], list[int]]


def _release(prefix: str, full: str, state: DetokState, total: int) -> str:
    """Release the text the tokens since `read_offset` add, unless it ends inside a
    character. Tokens that add no text at all (skipped special tokens) are passed over too:
    held back, they would widen every later window of the sequence (a model that keeps
    emitting them, e.g. with ``ignore_eos``, made each step's work grow with its output)."""
    if full.endswith(REPLACEMENT) or (len(full) <= len(prefix) and full != prefix):
        return ""
    delta = full[len(prefix):]
    state.release(delta, total)
    return delta


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
    state.append(delta)
    state.prefix_offset = state.read_offset = len(token_ids)
    return delta


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, soft hyphen...) for code points 256 and up, in
    byte order."""
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in own}
    shifted = sorted(set(range(256)) - set(own))
    alphabet.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return alphabet


class ByteTable:
    """Each token's bytes, for a byte-level BPE tokenizer whose decoding is exactly
    ``concat(bytes).decode("utf-8", "replace")``: `ids_bytes` is None for a token the check
    could not vouch for (a window containing one goes to the tokenizer)."""

    CHECK_STRINGS = 256  # random token strings decoded both ways when the table is built

    def __init__(self, plain: list[bytes | None], skipping: list[bytes | None]) -> None:
        self.plain, self.skipping = plain, skipping

    def ids_bytes(self, ids: list[int], skip: bool) -> bytes | None:
        table = self.skipping if skip else self.plain
        try:
            return b"".join([table[i] for i in ids])
        except (TypeError, IndexError):  # an unvouched or out-of-vocabulary id
            return None

    @classmethod
    def build(cls, tokenizer) -> ByteTable | None:
        """The table of a fast tokenizer with a plain ByteLevel decoder, checked against it;
        None for any other tokenizer or if the check fails on token strings."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except Exception:  # not a `tokenizers.Tokenizer`
            return None
        if decoder.get("type") != "ByteLevel":
            return None
        alphabet = _byte_level_alphabet()
        n = backend.get_vocab_size(with_added_tokens=True)
        plain: list[bytes | None] = [None] * n
        skipping: list[bytes | None] = [None] * n
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        for i in range(n):
            piece = backend.id_to_token(i)
            if piece is not None and all(c in alphabet for c in piece):
                plain[i] = bytes(alphabet[c] for c in piece)
                skipping[i] = b"" if i in special else plain[i]
        # Every token alone, both ways; a token that disagrees is left to the tokenizer.
        for skip, table in ((False, plain), (True, skipping)):
            texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=skip)
            for i, text in enumerate(texts):
                b = table[i]
                if b is not None and b.decode("utf-8", "replace") != text:
                    plain[i] = skipping[i] = None
        # Token strings: decoding must not depend on neighbours (it does not for byte-level
        # BPE; a tokenizer whose decoder does anything more fails here and is not used).
        rng = np.random.default_rng(0)
        known = np.array([i for i in range(n) if plain[i] is not None], np.int64)
        if not len(known):
            return None
        strings = [rng.choice(known, int(rng.integers(2, 24))).tolist()
                   for _ in range(cls.CHECK_STRINGS)]
        table = cls(plain, skipping)
        for skip in (False, True):
            texts = backend.decode_batch(strings, skip_special_tokens=skip)
            for ids, text in zip(strings, texts, strict=True):
                if table.ids_bytes(ids, skip).decode("utf-8", "replace") != text:
                    logger.info("byte table disagrees with the tokenizer on %s: not used", ids)
                    return None
        return table


# One table per tokenizer object (building it decodes the whole vocabulary once).
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer) -> ByteTable | None:
    """`ByteTable.build`, once per tokenizer; None (the windowed path) if building fails."""
    try:
        if tokenizer in _TABLES:
            return _TABLES[tokenizer]
    except TypeError:  # not weakly referenceable: build every time
        return _build(tokenizer)
    table = _TABLES[tokenizer] = _build(tokenizer)
    return table


def _build(tokenizer) -> ByteTable | None:
    try:
        return ByteTable.build(tokenizer)
    except Exception:  # an unusual backend: a shortcut is never worth failing the engine
        logger.warning("no byte table for this tokenizer; detokenizing through it",
                       exc_info=True)
        return None


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
        self._table = byte_table(tokenizer)
        self._texts: tuple[tuple[str | None, ...], tuple[str | None, ...]] | None = None
        # Built now (~10 ms beside the byte table's ~300), before a server freezes its
        # start-up heap (`LLMEngine.freeze_gc`). Built at the first steady step, the two
        # vocabulary-long tables were young objects that the next collections scanned
        # whole: 0.9 ms, the slowest steps of `bench/host_overhead.py --mixes mixed`.
        self.token_texts()

    def token_texts(self) -> tuple[tuple[str | None, ...], tuple[str | None, ...]] | None:
        """Each token's text when it is whole characters (the byte table's bytes decoded),
        else None, indexed ``[skip_special_tokens][token_id]``; None without a byte table.
        The text of a sequence whose released text ends where its new token starts is then
        one lookup (`OutputProcessor.stream_rows`). Tuples of strings, which the cyclic
        collector stops tracking the first time it sees them (lists it would scan again in
        every collection of their generation)."""
        if self._texts is None and self._table is not None:
            plain: list[str | None] = []
            for data in self._table.plain:
                text = None if data is None else data.decode("utf-8", "replace")
                plain.append(None if text is None or text.endswith(REPLACEMENT) else text)
            skipping = tuple(t if s == p else (None if s is None else "")  # skipped: no text
                             for t, s, p in zip(plain, self._table.skipping, self._table.plain))
            self._texts = (tuple(plain), skipping)
        return self._texts

    def _decode_many(self, windows: list[list[int]], skip: bool) -> list[str]:
        if self._batch is not None:
            return self._batch(windows, skip_special_tokens=skip)
        return [self.tokenizer.decode(w, skip_special_tokens=skip) for w in windows]

    def append_token(self, state: DetokState, token_id: int, total: int, skip: bool) -> bool:
        """The common case of a step, without a window: ``token_id`` is the sequence's only
        token past released text (``state.read_offset == total - 1``) and the byte table
        vouches for it. Returns False, having changed nothing, otherwise (then `step`)."""
        table = self._table
        if table is None or state.read_offset != total - 1:
            return False
        try:
            data = (table.skipping if skip else table.plain)[token_id]
        except IndexError:
            return False
        if data is None:
            return False
        text = data.decode("utf-8", "replace")
        if not text.endswith(REPLACEMENT):  # else held back, as in `step`
            state.release(text, total)
        return True

    def step(self, items: Sequence[tuple[Slicer, int, DetokState, bool]]) -> list[str]:
        """One incremental step for each ``(slice_fn, num_tokens, state, skip_special)``;
        returns each item's released delta."""
        deltas = [""] * len(items)
        slow = range(len(items))
        if self._table is not None:
            slow = []
            ids_bytes = self._table.ids_bytes
            for i, (get, total, st, skip) in enumerate(items):
                data = ids_bytes(get(st.read_offset, total), skip)
                if data is None:
                    slow.append(i)
                    continue
                # The released text ends on a character boundary, so the new tokens' text is
                # their bytes alone; held back while they end inside a character. No bytes
                # (skipped special tokens) leave nothing pending: move on (see `_release`).
                text = data.decode("utf-8", "replace")
                if not text.endswith(REPLACEMENT):
                    st.release(text, total)
                    deltas[i] = text
        for skip in (False, True):
            idx = [i for i in slow if items[i][3] == skip]
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
        data = (self._table.ids_bytes(get(state.read_offset, total), skip)
                if self._table is not None else None)
        if data is not None:
            delta = data.decode("utf-8", "replace")
            state.append(delta)
            state.prefix_offset = state.read_offset = total
            return delta
        prefix, full = self._decode_many([get(state.prefix_offset, state.read_offset),
                                          get(state.prefix_offset, total)], skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        state.append(delta)
        state.prefix_offset = state.read_offset = total
        return delta
