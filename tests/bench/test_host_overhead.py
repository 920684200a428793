"""bench/host_overhead.py stubs the runner and sampler: the engine's view of a runner grows,
and a stub that lags it stops the benchmark (it did once). This runs the benchmark's measurement
at a tiny size so the stub is kept in step with the engine."""

from __future__ import annotations

import numpy as np

from bench.host_overhead import measure
from models.loader import read_config


def test_measure_runs_the_real_engine_over_the_stub(demo_gguf, demo_tokenizer):
    config = read_config(str(demo_gguf))
    for mix in ("greedy", "mixed", "sampled", "sampled_one_lp", "sampled_stops", "sampled_lp"):
        for kind in ("cumulative", "engine_process"):  # the latter: text-free + the pipe's message
            trace: list = []
            row = measure(4, 3, mix, demo_tokenizer, config, output_kind=kind,
                          freeze_gc=False, trace=trace)
            assert row["num_seqs"] == 4 and row["steps"] == 3 and row["mix"] == mix
            assert 0 < row["median_ms"] <= row["p99_ms"] <= row["max_ms"]
            assert len(trace) == 3 and all(t > 0 and p > 0 for t, p in trace)
            assert max(t for t, _ in trace) == row["max_ms"]
            assert 0 < row["probe_us_p10"] <= row["probe_us_median"]
            assert row["p99_speed_adjusted_ms"] > 0 and row["gc_max_ms"] >= 0


def test_front_end_decodes_each_message_both_ways(demo_gguf, demo_tokenizer, monkeypatch):
    """`front_end` times the parent's side of the timed steps: their messages as sent (the
    steady steps' rows as `pipe_block`s) and as one row each, decoding to equal outputs."""
    import pickle

    import bench.host_overhead as ho
    from pagedjax.serving.engine_process import decode_outputs, encode_outputs

    monkeypatch.setitem(ho.ENGINE_ARGS, "async_scheduling", True)
    config = read_config(str(demo_gguf))
    msgs: list = []
    measure(6, 5, "mixed", demo_tokenizer, config, output_kind="engine_process",
            freeze_gc=False, messages=msgs)
    assert len(msgs) == 5
    rows = pickle.loads(msgs[-1])[1]
    assert any(r[0] is None and r[3] is not None for r in rows)  # a logprob block
    assert any(r[0] is None and r[3] is None for r in rows)  # a plain one
    prompts = {rid: ("p", [1], 0, 0, 1.0) for r in rows for rid in r[1]}
    outs = decode_outputs(rows, dict(prompts))
    assert len(outs) == 6 and all(len(o.outputs[0].token_ids) == 1 for o in outs)
    again = decode_outputs(encode_outputs(outs, set(prompts)), dict(prompts))
    assert [(o.request_id, o.outputs) for o in again] == [(o.request_id, o.outputs) for o in outs]
    got = ho.front_end(msgs, reps=1)
    assert got["front_end_as_sent_median_ms"] > 0 and got["front_end_as_rows_median_ms"] > 0
    assert 0 < got["message_bytes_as_sent"] < got["message_bytes_as_rows"]


def test_measure_runs_async_scheduling_over_the_stub(demo_gguf, demo_tokenizer, monkeypatch):
    """`--engine-arg async_scheduling=true`: each step launched before the last one's tokens
    are applied, as a CPU engine runs by default; the steps are steady decode steps."""
    import bench.host_overhead as ho
    import pagedjax.engine as engine_mod

    monkeypatch.setitem(ho.ENGINE_ARGS, "async_scheduling", True)
    launched = []
    real = engine_mod.LLMEngine._launch

    def spy(self, sched, prev):
        launched.append((prev is not None, sched.steady is not None))
        return real(self, sched, prev)

    monkeypatch.setattr(engine_mod.LLMEngine, "_launch", spy)
    config = read_config(str(demo_gguf))
    for mix in ("greedy", "mixed"):
        launched.clear()
        row = measure(4, 6, mix, demo_tokenizer, config, output_kind="final_only",
                      freeze_gc=False)
        assert row["steps"] == 6 and row["median_ms"] > 0
        # Timed steps overlapped the step before and were steady (the stub's 8 settling
        # steps come first).
        assert launched[-6:] == [(True, True)] * 6, launched


def test_tail_scales_slow_spells_of_the_host_but_keeps_the_engines_own_spikes():
    """`_tail`: steps slowed with their probe (a slow spell of the host) come back to the fast
    speed; a step slowed alone (a collection, say) stays in the adjusted p99."""
    from bench.host_overhead import _tail

    rng = np.random.default_rng(0)
    base = 1e-3 * (0.9 + 0.02 * rng.random(200))  # 0.90-0.92 ms at the fast speed
    probes = np.full(200, 60.0)
    slow = slice(50, 110)  # a spell at 1.5x: the steps and their probes alike
    times, probes = base.copy(), probes.copy()
    times[slow] *= 1.5
    probes[slow] *= 1.5
    row = _tail(list(times), list(probes), [(0, 0.0017), (0, 0.0004), (1, 0.002)])
    assert 1.3 < sorted(times)[198] * 1e3 < 1.4  # the raw p99 is the spell's
    assert 0.9 <= row["p99_speed_adjusted_ms"] <= 0.92
    assert row["probe_us_p10"] == 60.0 and row["probe_us_median"] == 60.0
    assert row["gc_collections"] == {"0": 2, "1": 1} and abs(row["gc_max_ms"] - 2.0) < 1e-9
    times[[10, 20, 30]] = 2.5e-3  # the engine's own spikes, at the fast speed
    assert 2.4 < _tail(list(times), list(probes), [])["p99_speed_adjusted_ms"] <= 2.5


def test_phases_time_each_stage_of_the_timed_steps_and_restore(demo_gguf, demo_tokenizer,
                                                              monkeypatch):
    """`--phases`: every stage it names is called during the timed steps (a renamed stage would
    record 0 or fail to wrap), nested stages fit in their parents, and the wrappers go away."""
    import bench.host_overhead as ho
    import pagedjax.core.scheduler as sched_mod
    from bench.host_overhead import _Phases
    from pagedjax.engine import LLMEngine

    # Async scheduling (the CPU default): the pending-token and token-feed stages run too.
    monkeypatch.setitem(ho.ENGINE_ARGS, "async_scheduling", True)
    before = sched_mod.Scheduler.__dict__["schedule"]
    config = read_config(str(demo_gguf))
    ph = _Phases()
    try:
        # Mixed: plain greedy steps build no sampling metadata, a stage this must see. On
        # the general path (no row listed), as steps of rows `listed_rows` cannot take run:
        # `process` detokenizes (`listed_rows` and `stream_rows` look the benchmark's
        # whole-character tokens up in their tables instead).
        with monkeypatch.context() as m:
            m.setattr(LLMEngine, "LISTED_MAX_SHARE", 0.0)
            measure(4, 3, "mixed", demo_tokenizer, config, output_kind="cumulative",
                    freeze_gc=False, phases=ph)
        # The listed path's stage (every row listed: cumulative outputs).
        measure(4, 3, "mixed", demo_tokenizer, config, output_kind="cumulative",
                freeze_gc=False, phases=ph)
        # Greedy delta streams: a steady cohort's rows stream from its columns (`stream
        # rows`), a stage the cumulative mix never reaches. The times add to the same stages.
        measure(4, 3, "greedy", demo_tokenizer, config, output_kind="delta",
                freeze_gc=False, phases=ph)
    finally:
        ph.restore()
    ms = {k.strip(): v for k, v in ph.ms.items()}
    assert all(v > 0 for v in ms.values()), ms
    assert (ms["step inputs"] + ms["sampled rows"] + ms["sampling metadata"]
            + ms["pending tokens"] + ms["token feed"] <= ms["launch"])
    assert ms["detokenization"] <= ms["output processing"] <= ms["apply samples"] <= ms["finish"]
    assert sched_mod.Scheduler.__dict__["schedule"] is before


def test_calls_count_the_timed_steps_only(demo_gguf, demo_tokenizer):
    """`--calls`: the count covers the timed steps (twice the steps, about twice the calls;
    a step's count grows with its sequences), and the profiler is off after."""
    from bench.host_overhead import _Calls

    config = read_config(str(demo_gguf))
    counts = {}
    for n, steps in ((2, 3), (8, 3), (8, 6)):
        calls = _Calls()
        measure(n, steps, "greedy", demo_tokenizer, config, output_kind="final_only",
                freeze_gc=False, phases=calls)
        assert not calls.on
        r = calls.per_step(steps)
        counts[n, steps] = r["calls_per_step"] * steps
        assert r["top_calls_per_step"] and max(r["top_calls_per_step"].values()) \
            <= r["calls_per_step"]
    assert counts[8, 3] > counts[2, 3]
    assert 1.6 < counts[8, 6] / counts[8, 3] < 2.4  # per step, not per run


def test_metadata_ab_times_both_builds():
    """`--metadata`: both builds run on the same rows (and agree: the engine's test checks
    that field by field)."""
    from bench.host_overhead import metadata_ab

    r = metadata_ab(4, 1)
    assert r["rows"] == 4 and r["from_params_ms"][0] > 0 and r["sampling_batch_ms"][0] > 0


def test_gc_threshold_round_sets_the_young_generation_and_restores_it(demo_gguf, demo_tokenizer):
    """`--compare-gc-threshold`: the B rounds run with the asked young generation, on top of
    the engine's own freeze; every round leaves the collector's thresholds as it found them
    (and the heap unfrozen, for the next engine)."""
    import gc

    from pagedjax.engine import YOUNG_GC_THRESHOLD

    config = read_config(str(demo_gguf))
    before = gc.get_threshold()
    a = measure(4, 3, "greedy", demo_tokenizer, config, "final_only", freeze_gc=True)
    b = measure(4, 3, "greedy", demo_tokenizer, config, "final_only", freeze_gc=True,
                gc_threshold=1234)
    assert a["gc_gen0_threshold"] == max(before[0], YOUNG_GC_THRESHOLD)
    assert b["gc_gen0_threshold"] == 1234
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_ab_summary_groups_runs_by_configuration_and_version():
    """`bench/host_overhead_ab.py`: each configuration's runs on each side, and the median
    of the runs' medians."""
    from bench.host_overhead_ab import summarize

    def run(version, med):
        return {"version": version, "rows": [
            {"output_kind": "final_only", "mix": "greedy", "num_seqs": 256, "median_ms": med,
             "p99_ms": med + 1}]}

    s = summarize([run("base", 2.0), run("new", 1.0), run("new", 1.4), run("base", 3.0),
                   run("base", 2.2)])
    side = s["final_only greedy 256"]
    assert side["base"]["median_ms"] == [2.0, 3.0, 2.2] and side["base"]["median_of_runs_ms"] == 2.2
    assert side["new"]["p99_ms"] == [2.0, 2.4] and side["new"]["median_of_runs_ms"] == 1.2
    assert side["new"]["gc_collections"] == []  # rows without the tail fields: nothing made up
    tail = {"max_ms": 3.0, "p99_speed_adjusted_ms": 1.5, "gc_max_ms": 0.4,
            "gc_collections": {"0": 2}}
    s = summarize([{"version": "new", "rows": [{**run("new", 1.0)["rows"][0], **tail}]}])
    new = s["final_only greedy 256"]["new"]
    assert {f: new[f] for f in tail} == {f: [v] for f, v in tail.items()}


def test_lockstep_referees_both_versions_in_turns(demo_gguf, tmp_path):
    """`host_overhead_ab.py --lockstep`: two processes (here the same tree twice) run their
    timed steps as refereed over pipes (`host_overhead.py --baton`), every configuration
    and step accounted for, and the paired per-step ratios come from their traces."""
    import argparse

    from bench.host_overhead_ab import ROOT, paired_ratios, run_lockstep

    args = argparse.Namespace(seqs="4,8", kinds="final_only", mixes="greedy", steps=5, turn=2,
                              engine_arg=[], cpu=0)
    got = run_lockstep({"base": ROOT, "new": ROOT}, args, tmp_path, 0, "new")
    for rows, trace in got.values():
        assert [(r["num_seqs"], r["steps"]) for r in rows] == [(4, 5), (8, 5)]
        assert [len(t["step_ms_and_probe_us"]) for t in trace] == [5, 5]
    ratios = paired_ratios(got["base"][1], got["new"][1])
    assert set(ratios) == {"final_only greedy 4", "final_only greedy 8"}
    assert all(r > 0 for r in ratios.values())


def test_paired_ratios_pair_steps_by_index():
    from bench.host_overhead_ab import paired_ratios

    def trace(ms):
        return [{"output_kind": "delta", "mix": "greedy", "num_seqs": 256,
                 "step_ms_and_probe_us": [(t, 60.0) for t in ms]}]

    # Step k against step k: a slow spell at steps 2-3 on both sides cancels out.
    got = paired_ratios(trace([1.0, 1.0, 3.0, 3.0, 1.0]), trace([0.5, 0.5, 1.5, 1.5, 0.5]))
    assert got == {"delta greedy 256": 0.5}
