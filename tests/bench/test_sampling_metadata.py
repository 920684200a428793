"""`bench/sampling_metadata.py`: both variants build the same metadata and the run writes both,
sampling the same tokens."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("sampling_metadata",
                                                  ROOT / "bench/sampling_metadata.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_variants_build_the_same_metadata():
    bench = _bench()
    hist = (np.zeros((6, bench.HISTORY), np.int32),) * 2
    host = bench.Variant(6, None, hist).metadata()
    dev = bench.Variant(6, bench.DeviceFill(), hist).metadata()
    assert isinstance(dev.banned_token_ids, jax.Array)
    assert isinstance(host.banned_token_ids, np.ndarray)
    assert host.allowed_bitmask.shape == (6, -(-bench.VOCAB // 32))  # the fixed widths
    for x, y in zip(jax.tree.leaves(host), jax.tree.leaves(dev), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_main_writes_both_variants(tmp_path, monkeypatch):
    bench = _bench()
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["sampling_metadata.py", "--rows", "4", "--iters", "3",
                                      "--reps", "2", "--out", str(out)])
    bench.main()
    res = json.loads(out.read_text())
    assert res["same_tokens"] is True
    assert set(res["variants"]) == {"host", "device"}
    assert all(v["total_median_ms"] >= v["build_median_ms"] > 0
               for v in res["variants"].values())
