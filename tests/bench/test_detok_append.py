"""`bench/detok_append.py`: its two policies keep the same text, and its `merging` baseline is
the merging one (few pieces, earlier ones rewritten) while `DetokState` only adds pieces."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("detok_append", ROOT / "bench/detok_append.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_policies_agree_and_differ_only_in_pieces():
    bench = _bench()
    merged, pieces = bench.MergingState(), bench.DetokState()
    for step in range(2000):
        for state in (merged, pieces):
            state.append(bench.PIECES[step % len(bench.PIECES)])
    chars = merged.length
    assert chars == pieces.length > 8000
    tail, longest = bench.DetokState.TAIL, max(len(p) for p in bench.PIECES)
    assert chars // (tail + longest) <= len(pieces._parts) <= chars // tail  # one per full tail
    assert len(merged._parts) <= 2 * chars.bit_length()  # merged: logarithmic
    assert merged.text == pieces.text


def test_main_writes_both_policies(tmp_path, monkeypatch):
    bench = _bench()
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["detok_append.py", "--seqs", "4", "--steps", "300",
                                      "--reps", "2", "--out", str(out)])
    bench.main()
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"merging", "pieces"}
    assert res["characters_at_end"] == sum(len(bench.PIECES[i % 4]) for i in range(300))
    for s in res["policies"].values():
        assert 0 < s["median_ms"] <= s["p99_ms"] <= s["max_ms"]
        assert len(s["steps_over_0.15_ms_per_rep"]) == 2
