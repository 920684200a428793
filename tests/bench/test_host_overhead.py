"""bench/host_overhead.py stubs the runner and sampler: the engine's view of a runner grows,
and a stub that lags it stops the benchmark (it did once). This runs the benchmark's measurement
at a tiny size so the stub is kept in step with the engine."""

from __future__ import annotations

from bench.host_overhead import measure
from models.loader import read_config


def test_measure_runs_the_real_engine_over_the_stub(demo_gguf, demo_tokenizer):
    config = read_config(str(demo_gguf))
    for mix in ("greedy", "mixed"):
        row = measure(4, 3, mix, demo_tokenizer, config, output_kind="cumulative",
                      freeze_gc=False)
        assert row["num_seqs"] == 4 and row["steps"] == 3 and row["mix"] == mix
        assert 0 < row["median_ms"] <= row["p99_ms"] <= row["max_ms"]
