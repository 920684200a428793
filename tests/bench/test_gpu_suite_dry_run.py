"""The GPU suite's harness on CPU (``--dry-run``), and the committed GPU goldens kept current.

No GPU runs in CI: these tests check that every stage of ``python -m bench.gpu_suite`` runs end
to end, writes its JSON with measured (not placeholder) contents and exercises the engine
features it claims to, and that the goldens the GPU compares with still match what the CPU
engine computes for the seeded demo-shape model.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from bench.gpu_suite import goldens as G
from bench.gpu_suite.__main__ import main
from bench.gpu_suite.common import Recorder
from bench.gpu_suite.seeded import SPECS, fingerprint, seeded_numpy, tensor_shapes
from bench.gpu_suite.stage_bench import launch_kwargs
from bench.gpu_suite.stage_kernels import parse_pytest_log
from bench.gpu_suite.stage_paper import summarize as paper_summary
from models.config import ModelConfig
from pallas_kernels import cpu_native


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    rc = main(["--stage", "all", "--dry-run", "--out", str(out)])
    return rc, out


def _load(out, stage):
    return json.loads((out / f"{stage}.json").read_text())


def test_dry_run_passes_and_writes_every_stage(dry_run, capsys):
    rc, out = dry_run
    assert rc == 0
    for stage in ("kernels", "bench", "e2e", "paper"):
        rec = _load(out, stage)
        assert rec["status"] == "done", (stage, rec["status"])
        assert rec["dry_run"] is True and rec["platform"] == "cpu"
        assert rec["summary"] and not [r for r in rec["summary"] if r["verdict"] == "FAIL"]


def test_kernels_stage_ran_the_tests(dry_run):
    rec = _load(dry_run[1], "kernels")
    assert rec["interpret_mode"] is True  # CPU: interpreted
    res = rec["pytest"]
    assert res["returncode"] == 0 and res["passed"] >= 10 and res["failed"] == 0
    assert res["summary_line"] and (dry_run[1] / "kernels_junit.xml").stat().st_size > 0


def test_bench_stage_rows_and_tuning_file(dry_run):
    out = dry_run[1]
    rec = _load(out, "bench")
    assert rec["copy_gbps"] > 0 and rec["read_gbps"] > 0
    timed = [r for r in rec["decode"] if "time_ms" in r]
    assert {r["variant"] for r in timed} == {"paged", "contiguous", "xla_ref"}
    assert all(r["time_ms"] > 0 and r["gbps"] > 0 for r in timed)
    assert rec["ragged"] and all(r["mixed_ms"] > 0 and r["separate_ms"] > 0 for r in rec["ragged"])
    tuning = json.loads((out / "tuning_cpu.json").read_text())
    assert {r["kernel"] for r in tuning} == {"decode", "ragged"}
    for r in tuning:
        assert r["time_ms"] > 0 and r["chunk_tokens"] == r["pages_per_chunk"] * r["block_size"]
        assert {"num_warps", "num_stages", "itemsize", "head_dim", "group", "arch"} <= set(r)
    assert len(rec["tuning"]) == 2 * 3  # default launch + 2 configs, per kernel


def test_e2e_stage_checks_pass_with_every_feature_exercised(dry_run):
    rec = _load(dry_run[1], "e2e")
    for dtype in ("float32", "bfloat16"):
        res = rec["goldens"][f"tiny/{dtype}"]
        assert res["ok"], dtype
        assert res["score"]["positions"] > 100 and res["score"]["max_abs_diff"] <= res["tol"]
        rc, sw, beam = res["greedy_recompute"], res["greedy_swap"], res["beam"]
        assert rc["features"]["preemptions"] > 0 and sw["features"]["blocks_swapped_out"] > 0
        assert rc["features"]["prefix_hit_tokens"] > 0 and rc["features"]["partial_prompt_chunks"] > 0
        assert beam["features"]["blocks_copied"] > 0
    assert rec["goldens"]["tiny/float32"]["score"]["max_abs_diff"] < 1e-4
    perf = rec["perf"]
    assert perf["decode_vs_roofline"] and all(r["step_ms"] > 0 for r in perf["decode_vs_roofline"])
    # The roofline is the read rate; the copy's (the first runs' reference) is kept beside it.
    for r in perf["decode_vs_roofline"]:
        assert r["roofline_ms"] == pytest.approx((perf["weight_bytes_read_per_step"] + r["batch"]
                                                  * r["context"] * perf["kv_bytes_per_token"])
                                                 / perf["read_gbps"] / 1e6)
        assert r["copy_roofline_ms"] > 0 and r["step_read_gbps"] > 0
        assert r["pipelined_step_ms"] > 0  # the same step dispatched back to back
    other = perf["other_layer_loop"]  # the first point again under the other layer loop
    assert other["layer_loop"] != perf["layer_loop"] and other["step_ms"] > 0
    assert perf["offline_sharegpt"]["output_tokens"] > 0
    mosaic = perf["mosaic_lowering"]  # the first and last points again, Mosaic-lowered kernels
    assert [(r["batch"], r["context"]) for r in mosaic] == [
        (r["batch"], r["context"]) for r in perf["decode_vs_roofline"][::len(perf["decode_vs_roofline"]) - 1]]
    assert all(r["mosaic_step_ms"] > 0 and r["triton_step_ms"] > 0 for r in mosaic)
    assert os.environ.get("PAGEDJAX_PALLAS_LOWERING") is None  # restored after
    # Batch 1 and the first point again with the other norm (on CPU the native norm is the
    # default where the library builds, so XLA's; else the Pallas kernel, interpreted), the
    # ratio fused / XLA's from the two.
    assert perf["fused_norm"] is cpu_native.available()
    norm = perf["fused_norm_ab"]
    assert [(r["batch"], r["context"]) for r in norm] == [(1, 32), (4, 64)]
    for r in norm:
        assert r["other_step_ms"] > 0 and r["other_pipelined_step_ms"] > 0
        fused, xla = ((r["default_step_ms"], r["other_step_ms"]) if perf["fused_norm"]
                      else (r["other_step_ms"], r["default_step_ms"]))
        assert r["fused_over_xla"] == pytest.approx(fused / xla)
    assert os.environ.get("PAGEDJAX_FUSED_NORM") is None
    ab = perf["async_ab"]  # the same requests with async scheduling on and off, same tokens
    assert [r["mode"] for r in ab["runs"]] == ["async", "sync", "async", "sync"]
    assert ab["identical"] and all(r["output_tokens"] > 0 for r in ab["runs"])
    assert all(r["compiles"] == 0 for r in ab["runs"])  # each mode warmed with the same run
    assert ab["async_over_sync"] > 0
    tk = perf["top_k_ab"]  # seeded sampled requests, two-stage and one-stage top-k
    assert [r["mode"] for r in tk["runs"]] == ["chunked", "one_stage"] * 2
    assert tk["identical"] and all(r["output_tokens"] > 0 for r in tk["runs"])
    assert all(r["compiles"] == 0 for r in tk["runs"]) and tk["chunked_over_one_stage"] > 0
    assert math.isfinite(perf["online_sharegpt"]["ttft_s"]["p50"])


def test_ab_switches_refuse_a_busy_engine():
    from bench.gpu_suite.stage_e2e import _set_async, _set_chunked_top_k

    class Busy:
        def has_unfinished_requests(self):
            return True

    for switch in (_set_async, _set_chunked_top_k):
        with pytest.raises(RuntimeError, match="still has requests"):
            switch(Busy(), True)


def test_paper_stage_result(dry_run):
    out = dry_run[1]
    rec = _load(out, "paper")
    result = json.loads((out / rec["result_file"]).read_text())
    assert result["config"]["model"] == "tiny-random"
    for w in ("sharegpt", "alpaca"):
        assert result[f"fig12_{w}"]["systems"]["paged"]["sustainable_rate"] > 0
    assert set(rec["ratios"]) >= {"sharegpt/contiguous-oracle", "sharegpt/contiguous-max"}
    # Each workload's real points follow its own sweep; every system is served for real.
    for w in ("sharegpt", "alpaca"):
        pts = result[f"real_{w}"]
        assert set(pts) == set(result[f"fig12_{w}"]["systems"])
        assert all(p["real"]["num_finished"] == p["num_requests"] > 0 for p in pts.values())
    assert [k for k in result if k.startswith(("fig12_", "real_"))] == \
        ["fig12_sharegpt", "real_sharegpt", "fig12_alpaca", "real_alpaca"]


# ---- goldens -------------------------------------------------------------------------------
def test_committed_goldens_are_small_and_match_the_weights():
    total = 0
    for name in G.GOLDEN_MODELS:
        g = G.load_golden(name)
        total += G.golden_path(name).stat().st_size
        spec = SPECS[name]
        assert g["fingerprint"] == fingerprint(spec.config, spec.seed)
        # Recorded before the config gained family fields; their defaults are these models'.
        assert ModelConfig.from_dict(g["config"]) == spec.config
        assert g["prompts"] == G.make_prompts(spec)
        assert all(len(x) == G.GEN_TOKENS for x in g["greedy"])
        assert sum(len(s["positions"]) for s in g["scored"]) > 150
        for dtype in ("float32", "bfloat16"):
            cal = g["cpu_calibration"][dtype]
            assert all(cal["recheck_ok"].values())
            assert cal["max_abs_diff"] < g["tolerance"][dtype]
    assert total < 1 << 20


def test_demo_golden_matches_the_cpu_engine_now():
    """Recompute two prompts of the demo golden (fp32): a stale file fails here, not on a GPU."""
    from bench.gpu_suite.seeded import seeded_params

    spec = SPECS["demo"]
    g = G.load_golden("demo")
    llm = G.build_llm(spec, seeded_params(spec.config, spec.seed), G.GOLDEN_ENGINE, "xla")
    few = {**g, "scored": g["scored"][:2]}
    seqs = [p + c for p, c in zip(g["prompts"][:2], g["greedy"][:2])]
    res = G.compare_scores(few, G.score(llm, seqs), g["tolerance"]["float32"], 1e-4)
    assert res["ok"] and res["violations"] == 0 and res["top1_raw"] == 1.0, res
    assert res["max_abs_diff"] < 1e-4
    outs = llm.generate([{"prompt_token_ids": g["prompts"][0]}], G._greedy(8), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == g["greedy"][0][:8]


def test_compare_scores_flags_a_wrong_value_and_a_missing_id():
    g = {"scored": [{"positions": [0], "top_ids": [[5, 6]], "top_lps": [[-1.0, -2.0]]}], "top1_min": 0.99}
    ok = G.compare_scores(g, [[{5: -1.0005, 6: -2.0}]], 2e-3, 1e-4)
    assert ok["ok"] and ok["violations"] == 0
    off = G.compare_scores(g, [[{5: -1.1, 6: -2.0}]], 2e-3, 1e-4)
    assert not off["ok"] and off["violations"] == 1
    gone = G.compare_scores(g, [[{5: -1.0, 7: -1.5}]], 2e-3, 1e-4)  # id 6 (-2.0) fell below -1.5: fine
    assert gone["violations"] == 0
    wrong = G.compare_scores(g, [[{5: -1.0, 7: -3.0}]], 2e-3, 1e-4)  # id 6 missing but above the 8th
    assert wrong["violations"] == 1


def test_greedy_divergence_must_be_at_a_near_tie():
    g = {"prompts": [[1, 2]], "greedy": [[3, 4, 5]],
         "scored": [{"positions": [1, 2, 3], "top_ids": [[3], [4], [5]],
                     "top_lps": [[-1.0, -3.0], [-1.0, -1.001], [-1.0, -2.0]]}]}
    assert G.compare_greedy(g, [[3, 4, 5]], 0.01)["ok"]
    assert G.compare_greedy(g, [[3, 9, 9]], 0.01)["ok"]  # diverged at a 0.001 margin
    bad = G.compare_greedy(g, [[9, 9, 9]], 0.01)  # diverged where the golden was 2 nats sure
    assert not bad["ok"] and bad["unexplained"][0]["at"] == 0


# ---- helpers -------------------------------------------------------------------------------
def test_fingerprint_hashes_each_streams_prefix():
    spec = SPECS["tiny"]
    flat = seeded_numpy(spec.config, spec.seed)
    # The fingerprint reads 4096 values from a fresh stream; they are the tensor's first values.
    for index, (path, _) in enumerate(tensor_shapes(spec.config)):
        if not path.endswith("norm"):
            head = np.random.default_rng([spec.seed, index]).random(4096, dtype=np.float32)
            want = (head - np.float32(0.5)) * np.float32(2 * 0.02 * 3**0.5)
            np.testing.assert_array_equal(flat[path].reshape(-1)[:4096], want)
    assert abs(float(flat["embed"].std()) - 0.02) < 1e-3
    assert fingerprint(spec.config, spec.seed) != fingerprint(spec.config, spec.seed + 1)


def test_parse_pytest_log_counts_partial_and_final_output():
    partial = ("tests/kernels/test_a.py::test_x[1] PASSED  [ 10%]\n"
               "tests/kernels/test_a.py::test_x[2] SKIPPED (no gpu) [ 20%]\n"
               "tests/kernels/test_a.py::test_y FAILED [ 30%]\n")
    res = parse_pytest_log(partial)
    assert (res["passed"], res["skipped"], res["failed"]) == (1, 1, 1)
    assert res["failures"] == ["tests/kernels/test_a.py::test_y"] and res["summary_line"] is None
    final = parse_pytest_log(partial + "==== 1 failed, 70 passed, 2 skipped in 12.3s ====\n")
    assert (final["passed"], final["failed"], final["skipped"]) == (70, 1, 2)


def test_parse_pytest_log_reads_xdist_lines():
    """With workers (the GPU run uses -n), -v lines put the outcome before the test id."""
    log = ("[gw0] [  1%] PASSED tests/kernels/test_a.py::test_x[1-pallas] \n"
           "[gw3] [ 12%] SKIPPED tests/kernels/test_a.py::test_x[1-cpu] \n"
           "[gw1] [100%] FAILED tests/kernels/test_b.py::test_y \n")
    res = parse_pytest_log(log)
    assert (res["passed"], res["skipped"], res["failed"]) == (1, 1, 1)
    assert res["failures"] == ["tests/kernels/test_b.py::test_y"]


def test_launch_kwargs_follow_the_kernel_signature():
    def old(q, *, num_warps=4, num_stages=2, pages_per_chunk=None, block_q=None):
        return q

    def new(q, *, num_warps=None, num_stages=None, chunk_tokens=None):
        return q

    cfg = {"num_warps": 8, "num_stages": 3, "pages_per_chunk": 4, "block_q": 32}
    assert launch_kwargs(old, 16, cfg) == cfg
    assert launch_kwargs(new, 16, cfg) == {"num_warps": 8, "num_stages": 3, "chunk_tokens": 64}
    assert launch_kwargs(old, 16, {}) == {}


def test_recorder_rewrites_complete_json_after_each_row(tmp_path):
    rec = Recorder(tmp_path, "x", {"device": "cpu"})
    rec.append("rows", {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text())["rows"] == [{"a": 1}]
    rec.append("rows", {"a": float("inf")})
    rec.summarize("item", "result", "pass")
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["rows"][1] == {"a": "inf"} and data["status"] == "running"
    assert not list(tmp_path.glob("*.tmp"))


def test_paper_verdict_is_the_issue_target(tmp_path):
    def result(oracle, mx):
        systems = {"paged": 4.0, "contiguous-oracle": oracle, "contiguous-pow2": 1.0,
                   "contiguous-max": mx, "static": 0.5}
        return {"cost_model": {"coef_s": [0.02], "in_sample_step_mape": 0.1},
                "fig12_sharegpt": {"systems": {s: {"sustainable_rate": r} for s, r in systems.items()}}}

    for (oracle, mx), verdict in (((2.0, 1.0), "pass"), ((2.1, 1.0), "FAIL"), ((1.0, 1.1), "FAIL")):
        rec = Recorder(tmp_path, f"p{oracle}{mx}", {})
        paper_summary(rec, result(oracle, mx), judge=True)
        row = next(r for r in rec.data["summary"] if r["item"].startswith("fig12 sharegpt"))
        assert row["verdict"] == verdict, (oracle, mx, row)
        assert rec.data["ratios"]["sharegpt/contiguous-oracle"] == 4.0 / oracle


def test_paper_verdict_needs_a_bounded_baseline(tmp_path):
    """A baseline that never crossed the threshold gives only an upper bound on the ratio."""
    systems = {"paged": (8.0, True), "contiguous-oracle": (2.0, True), "contiguous-pow2": (1.0, True),
               "contiguous-max": (1.0, False), "static": (0.5, True)}
    result = {"cost_model": {"coef_s": [0.02], "in_sample_step_mape": 0.1},
              "fig12_sharegpt": {"systems": {s: {"sustainable_rate": r, "bounded": b}
                                             for s, (r, b) in systems.items()}}}
    rec = Recorder(tmp_path, "p", {})
    paper_summary(rec, result, judge=True)
    row = next(r for r in rec.data["summary"] if r["item"].startswith("fig12 sharegpt"))
    assert row["verdict"] == "FAIL" and "<=8.00 Max" in row["result"] and "x4.00 Oracle" in row["result"]


def test_e2e_parts_pick_what_runs(tmp_path, monkeypatch):
    """GPU_SUITE_E2E picks the e2e parts and their order (the dry-run fixture runs both for
    real; here they are stubs, so the choice is tested in a second, not a rerun); a part
    that comes first runs on a share of the budget; a typo is refused by name."""
    from bench.gpu_suite import stage_e2e
    from bench.gpu_suite.__main__ import DRY_BUDGET_S, run_stage_in_process

    calls = []

    def stub(name):
        def part(rec, budget, dry_run, backend):
            calls.append((name, round(budget.seconds / DRY_BUDGET_S["e2e"], 2)))
            rec.summarize(f"{name} stub", "ran", "info")
        return part

    monkeypatch.setattr(stage_e2e, "correctness", stub("goldens"))
    monkeypatch.setattr(stage_e2e, "performance", stub("perf"))
    for env, want in (("perf", [("perf", None)]), ("goldens", [("goldens", None)]),
                      ("perf,goldens", [("perf", 0.7), ("goldens", None)]),
                      (None, [("goldens", 0.55), ("perf", None)])):
        calls.clear()
        if env is None:
            monkeypatch.delenv("GPU_SUITE_E2E", raising=False)  # the default order
        else:
            monkeypatch.setenv("GPU_SUITE_E2E", env)
        assert run_stage_in_process("e2e", tmp_path, DRY_BUDGET_S["e2e"], True) == 0
        rec = _load(tmp_path, "e2e")
        assert rec["parts"] == [name for name, _ in want]
        assert [name for name, _ in calls] == [name for name, _ in want]
        for (_, got), (_, share) in zip(calls, want):  # a share of what is left, or all
            assert got == 1.0 if share is None else 0 < got <= share
    monkeypatch.setenv("GPU_SUITE_E2E", "perf,golden")
    with pytest.raises(ValueError, match="GPU_SUITE_E2E"):
        run_stage_in_process("e2e", tmp_path, DRY_BUDGET_S["e2e"], True)


def test_resweep_redoes_the_sweeps_from_the_recorded_cost_model(dry_run, tmp_path):
    """`bench.paper.resweep` on the dry run's result, with the run's own trace span: the same
    deterministic replay, so the same sustainable rates; real points kept as measured."""
    from bench.paper.resweep import resweep

    out = dry_run[1]
    src = json.loads((out / _load(out, "paper")["result_file"]).read_text())
    res = resweep(src, None, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["resweep"] == res["resweep"]
    for w in ("sharegpt", "alpaca"):
        assert res["resweep"]["previous_sustainable_rate"][w] == {
            s: d["sustainable_rate"] for s, d in res[f"fig12_{w}"]["systems"].items()}
        assert res[f"real_{w}"] == src[f"real_{w}"]
