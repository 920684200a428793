"""The Poisson serving loop every peer worker shares (`bench/peers/protocol.run_arrivals`):
requests are added no earlier than their arrival, latencies count from arrival, and an engine
that goes idle with requests unfinished stops the run instead of spinning forever."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "peers"))
from protocol import run_arrivals  # noqa: E402


class _Engine:
    """Each request gets one token per step and finishes after `n` steps."""

    def __init__(self, n: int = 3, lose: str | None = None) -> None:
        self.n, self.lose, self.live, self.added = n, lose, {}, []

    def add(self, i: int) -> None:
        self.added.append(i)
        if str(i) != self.lose:
            self.live[str(i)] = []

    def step(self):
        outs = []
        for rid, toks in list(self.live.items()):
            toks.append(int(rid) + 100)
            done = len(toks) >= self.n
            outs.append(types.SimpleNamespace(
                request_id=rid, finished=done,
                outputs=[types.SimpleNamespace(token_ids=list(toks))]))
            if done:
                del self.live[rid]
        return outs

    def has_work(self) -> bool:
        return bool(self.live)


def test_requests_arrive_on_time_and_latency_counts_from_arrival():
    arrivals = [0.0, 0.05, 0.02]
    eng = _Engine()
    seconds, outputs, extra = run_arrivals(arrivals, eng.add, eng.step, eng.has_work)
    assert outputs == [[100] * 3, [101] * 3, [102] * 3]
    assert eng.added == [0, 2, 1]  # arrival order
    assert seconds >= 0.05
    assert all(0 <= f <= lat for f, lat in zip(extra["first_token_s"], extra["latency_s"]))


def test_an_engine_that_loses_a_request_stops_the_run():
    eng = _Engine(lose="1")
    with pytest.raises(RuntimeError, match="idle with 1 requests unfinished"):
        run_arrivals([0.0, 0.01], eng.add, eng.step, eng.has_work)
