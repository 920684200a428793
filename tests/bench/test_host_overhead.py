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


def test_phases_time_each_stage_of_the_timed_steps_and_restore(demo_gguf, demo_tokenizer):
    """`--phases`: every stage it names is called during the timed steps (a renamed stage would
    record 0 or fail to wrap), nested stages fit in their parents, and the wrappers go away."""
    import pagedjax.core.scheduler as sched_mod
    from bench.host_overhead import _Phases

    before = sched_mod.Scheduler.__dict__["schedule"]
    config = read_config(str(demo_gguf))
    ph = _Phases()
    try:
        # Mixed: plain greedy steps build no sampling metadata, a stage this must see.
        measure(4, 3, "mixed", demo_tokenizer, config, output_kind="cumulative",
                freeze_gc=False, phases=ph)
    finally:
        ph.restore()
    ms = {k.strip(): v for k, v in ph.ms.items()}
    assert all(v > 0 for v in ms.values()), ms
    assert ms["step inputs"] + ms["sampled rows"] + ms["sampling metadata"] <= ms["launch"]
    assert ms["detokenization"] <= ms["output processing"] <= ms["apply samples"] <= ms["finish"]
    assert sched_mod.Scheduler.__dict__["schedule"] is before


def test_metadata_ab_times_both_builds():
    """`--metadata`: both builds run on the same rows (and agree: the engine's test checks
    that field by field)."""
    from bench.host_overhead import metadata_ab

    r = metadata_ab(4, 1)
    assert r["rows"] == 4 and r["from_params_ms"][0] > 0 and r["sampling_batch_ms"][0] > 0
