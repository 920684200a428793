"""bench/stream_delivery.py and bench/http_stream.py at a tiny size: their stubs are the
`LLMEngine` interface `AsyncEngine` and the HTTP front door call, and a stub that lags it
would stop the benchmarks. Every token a stub step makes must reach its client."""

from __future__ import annotations

import pytest

from bench.http_stream import child as http_child
from bench.stream_delivery import child as delivery_child


def test_stream_delivery_child_delivers_every_token_and_times_full_steps():
    row = delivery_child(streams=12, tokens=6, device_ms=1.0)
    assert row["tokens_received"] == 12 * 6
    # The steps before the last each gave every stream one token and none finished.
    assert row["steps_timed"] == 5
    assert 0 < row["host_ms_median"] <= row["host_ms_p99"] <= row["host_ms_max"]
    assert row["cpu_ms_per_step"] > 0


@pytest.mark.parametrize("engine_process", [False, True])
def test_http_stream_child_serves_every_sse_chunk_over_a_real_server(engine_process):
    row = http_child(streams=6, tokens=20, step_ms=2.0, engine_process=engine_process)
    assert row["loop"] in ("uvloop", "asyncio") and row["steps"] >= 20
    assert row["engine"] == ("process" if engine_process else "thread")
    assert (row.get("engine_process_cpu_ms_per_step", 1.0) > 0)
    # A chunk a client had not read yet absorbs the next one, so at most one per token.
    assert 6 <= row["chunks"] <= 6 * 20
    assert row["steps_with_every_stream_open"] >= 1
    assert 0 < row["engine_gap_ms_median"] <= row["engine_gap_ms_p99"]
    assert row["server_cpu_ms_per_step"] > 0
