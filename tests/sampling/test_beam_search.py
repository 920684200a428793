"""Beam candidate selection vs brute force, and the host-side beam rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedjax.beam_search import (
    BeamCandidate,
    beam_candidates,
    length_penalized_score,
    should_stop,
    split_candidates,
)


def brute_force(logits, cum, live, c):
    """All (parent, token) pairs scored in float64, best first, ties by flat index."""
    out = []
    for g in range(logits.shape[0]):
        cands = []
        for w in range(logits.shape[1]):
            if not live[g, w]:
                continue
            row = logits[g, w].astype(np.float64)
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            cands += [(-(cum[g, w] + logp[t]), w * logits.shape[2] + t, w, t)
                      for t in range(logits.shape[2])]
        cands.sort()
        out.append([(w, t, -s) for s, _, w, t in cands[:c]])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_candidates_match_brute_force_with_padded_groups(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g, w, v = 5, 4, 97
    logits = (rng.normal(size=(g, w, v)) * 3).astype(np.float32)
    cum = rng.uniform(-20, 0, (g, w)).astype(np.float32)
    live = np.ones((g, w), bool)
    live[1, 2:] = False  # two live beams
    live[2, 1:] = False  # first step: one live beam
    live[3, [0, 2]] = False  # holes in the middle
    live[4] = False  # empty (padding) group
    got = beam_candidates(logits, cum, live)
    parent, tok, score, valid = (np.asarray(x) for x in got)
    assert parent.shape == (g, 2 * w)
    ref = brute_force(logits, cum, live, 2 * w)
    for gi in range(g):
        n = len(ref[gi])
        assert valid[gi].sum() == n
        assert [(int(p), int(t)) for p, t in zip(parent[gi, :n], tok[gi, :n])] == [
            (p, t) for p, t, _ in ref[gi]]
        np.testing.assert_allclose(score[gi, :n], [s for *_, s in ref[gi]], rtol=1e-5)
        assert live[gi, parent[gi, :n]].all()
    assert not valid[4].any() and np.isneginf(score[4]).all()


def test_candidates_custom_count_and_small_vocab() -> None:
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(2, 3, 4)).astype(np.float32)
    cum = np.zeros((2, 3), np.float32)
    live = np.array([[True, True, True], [True, False, False]])
    parent, tok, score, valid = (np.asarray(x) for x in
                                 beam_candidates(logits, cum, live, num_candidates=8))
    ref = brute_force(logits, cum, live, 8)
    assert valid[0].all() and valid[1].sum() == 4  # only 1 beam x 4 tokens exist
    assert [(int(p), int(t)) for p, t in zip(parent[1, :4], tok[1, :4])] == [
        (p, t) for p, t, _ in ref[1]]


def test_length_penalized_score() -> None:
    assert length_penalized_score(-6.0, 3) == -2.0
    assert length_penalized_score(-6.0, 4, 0.0) == -6.0
    assert math.isclose(length_penalized_score(-8.0, 4, 0.5), -4.0)


def test_split_candidates() -> None:
    eos = {0}
    # best-first: eos at rank 0 finishes; eos at rank 3 (>= width 2) is dropped.
    parents = [1, 0, 0, 1, 1]
    tokens = [0, 5, 6, 0, 7]
    scores = [-1.0, -1.5, -2.0, -2.5, -3.0]
    live, fin = split_candidates(parents, tokens, scores, 2, eos)
    assert fin == [BeamCandidate(1, 0, -1.0)]
    assert live == [BeamCandidate(0, 5, -1.5), BeamCandidate(0, 6, -2.0)]
    live, fin = split_candidates([0, 0, 0], [0, 0, 3], [-1.0, -2.0, -3.0], 2, eos)
    assert len(fin) == 2 and live == [BeamCandidate(0, 3, -3.0)]
    live, fin = split_candidates([0, 0], [4, 5], [-1.0, float("-inf")], 2, eos,
                                 valid=[True, False])
    assert live == [BeamCandidate(0, 4, -1.0)] and fin == []


def test_should_stop_rules() -> None:
    kw = dict(beam_width=2, length_penalty=1.0, max_seq_len=100)
    # Not enough finished hypotheses: never stop.
    assert not should_stop([-1.0], -0.1, 10, early_stopping=True, **kw)
    assert should_stop([-1.0, -2.0], -0.1, 10, early_stopping=True, **kw)
    # False: compare worst finished (-2.0) with the live beam at its length.
    assert should_stop([-1.0, -2.0], -30.0, 10, early_stopping=False, **kw)  # -3.0
    assert not should_stop([-1.0, -2.0], -10.0, 10, early_stopping=False, **kw)  # -1.0
    # "never": live beam could reach max_seq_len -> -30/100 = -0.3 beats -2.0.
    assert not should_stop([-1.0, -2.0], -30.0, 10, early_stopping="never", **kw)
    assert should_stop([-1.0, -2.0], -300.0, 10, early_stopping="never", **kw)  # -3.0
    # "never" with length_penalty <= 0 falls back to the current length.
    kw0 = dict(kw, length_penalty=0.0)
    assert should_stop([-1.0, -2.0], -3.0, 10, early_stopping="never", **kw0)
