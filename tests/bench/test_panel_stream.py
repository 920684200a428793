"""bench/panel_stream.cc compiles the native matmul's own source and calls its internals: a
change there that breaks the harness fails here, not the next time someone measures."""

from __future__ import annotations

import shutil

import pytest

from bench.cpu_floor import panel_stream


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the native kernels do too)")
def test_panel_stream_builds_from_the_kernel_source_and_reports_each_row_count():
    res = panel_stream(rows=(1, 7))
    assert set(res) == {"1", "7"}
    for m, r in res.items():
        assert r["rows"] == int(m) and 530 < r["weights_mb"] < 545  # the demo model's panels
        for k in ("hot", "streamed", "streamed_2_threads", "hot_2_threads"):
            assert r[f"{k}_ms"] > 0 and r[f"{k}_gflop_per_s"] > 0
