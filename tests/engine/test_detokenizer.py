"""Batched incremental detokenization: same text as decoding everything at once, deltas never
split a character, per-step work reads only a window of each sequence, and the released text
is kept in pieces that behave as one string."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from pagedjax.detokenizer import (
    ByteTable,
    Detokenizer,
    DetokState,
    byte_table,
    detokenize_incrementally,
    flush,
)

TEXTS = ["Grüße aus Köln 🎉🎉 — ça va? 東京タワー", "plain ascii words and numbers 12345",
         "emoji🙂mixed🙂in👍🏽words", "\n\n  spaces\tand tabs  \n"]


class CountingSeq:
    """Token ids behind `get_token_slice`, recording how many ids each step reads."""

    def __init__(self, prompt: list[int], out: list[int]) -> None:
        self.prompt, self.out, self.n, self.read = prompt, out, 0, 0

    def get(self, a: int, b: int) -> list[int]:
        ids = (self.prompt + self.out[: self.n])[a:b]
        self.read += len(ids)
        return ids


@pytest.mark.parametrize("skip", [True, False])
def test_batched_equals_one_by_one_and_whole_decode(demo_tokenizer, skip):
    tok = demo_tokenizer
    rng = np.random.default_rng(0)
    seqs = []
    for i, text in enumerate(TEXTS * 2):
        ids = tok(text).input_ids
        if i >= len(TEXTS):  # random ids too, incl. special tokens
            ids = [int(t) for t in rng.integers(0, tok.vocab_size, 40)]
        seqs.append(CountingSeq(tok("Q:").input_ids, ids))
    det = Detokenizer(tok)
    assert det._batch is not None  # the fast path is what runs in the engine
    states = [DetokState("", max(0, len(s.prompt) - 5), len(s.prompt)) for s in seqs]
    ref_states = [DetokState("", max(0, len(s.prompt) - 5), len(s.prompt)) for s in seqs]
    for _ in range(max(len(s.out) for s in seqs)):
        live = [i for i, s in enumerate(seqs) if s.n < len(s.out)]
        for i in live:
            seqs[i].n += 1
        before = [s.read for s in seqs]
        deltas = det.step([(seqs[i].get, len(seqs[i].prompt) + seqs[i].n, states[i], skip)
                           for i in live])
        for i, d in zip(live, deltas):
            all_ids = seqs[i].prompt + seqs[i].out[: seqs[i].n]
            assert d == detokenize_incrementally(tok, all_ids, ref_states[i], skip)
            assert not d.endswith("\ufffd")
            assert seqs[i].read - before[i] <= 2 * 16  # a window, not the whole sequence
    for s, st, ref in zip(seqs, states, ref_states):
        total = len(s.prompt) + len(s.out)
        det.flush(s.get, total, st, skip)
        flush(tok, s.prompt + s.out, ref, skip)
        assert st.text == ref.text == tok.decode(s.out, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_append_token_equals_the_windowed_step(demo_tokenizer, skip):
    """`append_token` (one new token, read from the byte table) releases exactly what `step`
    releases, holds back split characters the same way, and declines (changing nothing)
    whatever it cannot do: a held-back window, an unvouched or out-of-vocabulary id."""
    tok = demo_tokenizer
    rng = np.random.default_rng(7)
    det = Detokenizer(tok)
    texts = [tok(t).input_ids for t in TEXTS]
    texts += [[int(t) for t in rng.integers(0, tok.vocab_size, 60)] for _ in range(4)]
    declined = 0
    for out in texts:
        seq = CountingSeq(tok("Q:").input_ids, out)
        fast, ref = (DetokState("", 0, len(seq.prompt)) for _ in range(2))
        for t in out:
            seq.n += 1
            total = len(seq.prompt) + seq.n
            before = (fast.text, fast.prefix_offset, fast.read_offset)
            if not det.append_token(fast, t, total, skip):
                assert (fast.text, fast.prefix_offset, fast.read_offset) == before
                declined += 1
                det.step([(seq.get, total, fast, skip)])
            det.step([(seq.get, total, ref, skip)])
            assert (fast.text, fast.prefix_offset, fast.read_offset) == \
                (ref.text, ref.prefix_offset, ref.read_offset)
        det.flush(seq.get, len(seq.prompt) + seq.n, fast, skip)
        assert fast.text == tok.decode(out, skip_special_tokens=skip)
    assert declined > 0  # split characters held back a window at least once
    st = DetokState("", 0, 3)
    assert not det.append_token(st, len(det._table.plain) + 5, 4, skip)
    assert not det.append_token(st, 7, 5, skip)  # two tokens past released text


@pytest.mark.parametrize("table", [True, False])
def test_skipped_special_tokens_do_not_widen_the_window(demo_tokenizer, table):
    """A sequence that keeps sampling special tokens (EOS with ignore_eos) while they are
    skipped adds no text; the window each step reads must stay short anyway (it used to grow
    with the output), on the byte-table path and the tokenizer's."""
    tok = demo_tokenizer
    eos = tok.eos_token_id
    out = tok(" hi").input_ids + [eos] * 60 + tok(" there é").input_ids + [eos] * 40
    seq = CountingSeq(tok("Q:").input_ids, out)
    det = Detokenizer(tok)
    if not table:
        det._table = None
    st = DetokState("", 0, len(seq.prompt))
    for _ in out:
        seq.n += 1
        before = seq.read
        det.step([(seq.get, len(seq.prompt) + seq.n, st, True)])
        assert seq.read - before <= 8
    det.flush(seq.get, len(seq.prompt) + seq.n, st, True)
    assert st.text == tok.decode(out, skip_special_tokens=True) == " hi there é"


def test_plain_decode_objects_work_without_backend():
    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    det = Detokenizer(Plain())
    st = DetokState("", 0, 1)
    ids = [7, 8, 9]
    assert det.step([(lambda a, b: ids[a:b], 3, st, True)]) == [" 8 9"]
    assert st.text == " 8 9"


def test_byte_table_vouches_for_the_demo_vocabulary(demo_tokenizer):
    """The demo tokenizer is byte-level BPE: every token gets its bytes, specials skip to b""."""
    table = byte_table(demo_tokenizer)
    assert table is not None and Detokenizer(demo_tokenizer)._table is table
    ids = [int(i) for i in np.random.default_rng(1).integers(0, len(table.plain), 500)]
    for skip in (False, True):
        got = table.ids_bytes(ids, skip).decode("utf-8", "replace")
        assert got == demo_tokenizer.decode(ids, skip_special_tokens=skip)
    eos = demo_tokenizer.eos_token_id
    assert table.ids_bytes([eos], True) == b"" and table.ids_bytes([eos], False)


def test_unvouched_and_out_of_vocabulary_ids_take_the_windowed_path(demo_tokenizer):
    """A token the table cannot vouch for (poisoned here to None) is decoded by the tokenizer,
    with the same deltas; other sequences of the step still use the table."""
    tok = demo_tokenizer
    det = Detokenizer(tok)
    ids = tok("naïve café 🙂 end").input_ids
    poisoned = ids[2]
    table = det._table
    old = table.plain[poisoned], table.skipping[poisoned]
    calls = []
    real = det._batch
    det._batch = lambda w, **k: (calls.append(w), real(w, **k))[1]
    try:
        table.plain[poisoned] = table.skipping[poisoned] = None
        prompt = tok("Q:").input_ids
        a, b = CountingSeq(prompt, ids), CountingSeq(prompt, list(reversed(ids)))
        sa, sb = (DetokState("", 0, len(prompt)) for _ in range(2))
        for _ in ids:
            a.n += 1
            b.n += 1
            det.step([(a.get, len(prompt) + a.n, sa, True), (b.get, len(prompt) + b.n, sb, True)])
        det.flush(a.get, len(prompt) + a.n, sa, True)
        det.flush(b.get, len(prompt) + b.n, sb, True)
    finally:
        table.plain[poisoned], table.skipping[poisoned] = old
    assert sa.text == tok.decode(ids, skip_special_tokens=True)
    assert sb.text == tok.decode(list(reversed(ids)), skip_special_tokens=True)
    assert calls and all(poisoned in sum(w, []) for w in calls)  # only windows holding it
    assert det._table.ids_bytes([len(table.plain) + 5], False) is None


def test_byte_table_refuses_other_decoders():
    class Backend:
        def to_str(self):
            return '{"decoder": {"type": "Metaspace"}}'

    class SentencePieceLike:
        _tokenizer = Backend()
        clean_up_tokenization_spaces = False

    assert ByteTable.build(SentencePieceLike()) is None
    assert ByteTable.build(object()) is None


def test_a_failing_table_build_leaves_the_windowed_path(demo_tokenizer, monkeypatch):
    """Building the table raising (an unusual backend) must not fail the engine."""
    from pagedjax import detokenizer as mod

    def boom(tokenizer):
        raise AttributeError("no get_added_tokens_decoder")

    monkeypatch.setattr(mod.ByteTable, "build", staticmethod(boom))
    monkeypatch.setattr(mod, "_TABLES", mod.weakref.WeakKeyDictionary())
    det = Detokenizer(demo_tokenizer)
    assert det._table is None
    ids = demo_tokenizer("grüße 🙂").input_ids
    st = DetokState("", 0, 0)
    det.step([(lambda a, b: ids[a:b], len(ids), st, True)])
    det.flush(lambda a, b: ids[a:b], len(ids), st, True)
    assert st.text == demo_tokenizer.decode(ids, skip_special_tokens=True)


class SmallTail(DetokState):
    """Pieces form after a few characters: the pieces, not only the tail, get exercised."""

    __slots__ = ()
    TAIL = 6


@pytest.mark.parametrize("cls", [DetokState, SmallTail])
@settings(max_examples=200, deadline=None)
@given(pieces=hst.lists(hst.text(max_size=40), max_size=300), data=hst.data())
def test_text_pieces_equal_one_string(cls, pieces, data):
    """`DetokState` keeps its text in a short tail and pieces: text, length and any tail
    equal a plain string's, a truncation (a stop string) resets it, an append never rewrites
    an earlier piece (no step copies the text so far), and every piece holds at least a
    full tail."""
    state, plain = cls(), ""
    for piece in pieces:
        before = list(state._parts)
        state.append(piece)
        plain += piece
        assert state.length == len(plain)
        assert all(a is b for a, b in zip(before, state._parts)) and \
            len(state._parts) - len(before) in (0, 1)
        assert all(len(p) >= cls.TAIL for p in state._parts)
        assert len(state._parts) <= max(1, len(plain)) // cls.TAIL + 1
        start = data.draw(hst.integers(-3, len(plain) + 3))
        assert state.tail(start) == plain[max(0, start):]
    assert state.text == plain and state.length == len(plain)
    cut = data.draw(hst.integers(0, len(plain)))
    state.text = state.text[:cut]
    state.append("xyz")
    assert state.text == plain[:cut] + "xyz" and state.tail(cut) == "xyz"
