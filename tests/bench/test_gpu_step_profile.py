"""`bench/gpu_step_profile.py`: the trace arithmetic against hand-built events, and the
harness a GPU session runs, at toy shapes on CPU (its times here are no claim)."""

import json

from bench.gpu_step_profile import busy_summary, kernel_class, main, thunk_summary


def test_busy_time_is_the_union_of_events_and_the_gap_the_rest():
    ms = 1_000_000
    events = [("fusion_1", 0, 2 * ms), ("fusion_2", 1 * ms, 2 * ms),  # overlap: busy 0-3
              ("gemm", 5 * ms, 1 * ms),  # idle 3-5
              ("fusion_3", 6 * ms, 4 * ms)]  # adjacent: busy 5-10
    s = busy_summary(events, steps=2)
    assert s["events_per_step"] == 2
    assert s["span_ms"] == 5.0 and s["busy_ms"] == 4.0 and s["gap_ms"] == 1.0
    assert s["top"][0] == {"kernel": "fusion", "per_step": 1.5, "ms": 4.0}
    assert s["top"][1] == {"kernel": "gemm", "per_step": 0.5, "ms": 0.5}
    assert busy_summary([], 3)["busy_ms"] == 0.0


def test_kernel_class_drops_instance_numbers_only():
    assert kernel_class("loop_add_fusion_3") == "loop_add_fusion"
    assert kernel_class("input_reduce_fusion.12") == "input_reduce_fusion"
    assert kernel_class("paged_decode_g4_d128_c64_bs16") == "paged_decode_g4_d128_c64_bs16"
    assert kernel_class("sm90_xmma_gemm_bf16") == "sm90_xmma_gemm_bf16"


def test_harness_runs_each_variant_in_its_own_process(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--model", "tiny", "--points", "2x32", "--steps", "2", "--iters", "4",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["variants"]) == {"default", "no_command_buffers", "graphs_in_trace"}
    # What each child process saw, not what the parent meant to give it.
    seen = {k: v["xla_flags_seen"] for k, v in res["variants"].items()}
    assert "--xla_gpu_enable_command_buffer=" in seen["no_command_buffers"]
    assert "--xla_enable_command_buffers_during_profiling=true" in seen["graphs_in_trace"]
    assert "--xla_dump_to=" in seen["default"] and "--xla_dump_to=" not in seen["graphs_in_trace"]
    assert "--xla_gpu_enable_command_buffer=" not in seen["default"]
    assert isinstance(res["variants"]["default"]["thunks"]["files"], list)
    for v in res["variants"].values():
        (pt,) = v["points"]
        assert (pt["batch"], pt["context"]) == (2, 32)
        assert pt["sync_ms"] > 0 and pt["pipelined_ms"] > 0
        assert pt["trace"]["events_per_step"] > 0 and pt["trace"]["busy_ms"] > 0
        assert pt["trace"]["span_ms"] >= pt["trace"]["busy_ms"]
    assert res["load_avg_1m_at_start"] >= 0


def test_thunk_summary_counts_kinds_in_the_largest_dump(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m1.thunk_sequence.txt").write_text(
        "kCommandBuffer {\n  kKernel f1\n  kKernel f2\n}\nkConditional\nkKernel f3\n")
    (tmp_path / "m0.thunk_sequence.txt").write_text("kKernel\n")
    (tmp_path / "m0.hlo.txt").write_text("kKernel kKernel kKernel kKernel kKernel kKernel\n")
    res = thunk_summary(str(tmp_path))
    assert res["largest"] == "m1.thunk_sequence.txt" and len(res["files"]) == 2
    big, small = res["counts"]["m1.thunk_sequence.txt"], res["counts"]["m0.thunk_sequence.txt"]
    assert big["kCommandBuffer"] == 1 and big["kKernel"] == 3  # nested kernels counted
    assert big["kConditional"] == 1 and big["kWhile"] == 0
    assert small["kKernel"] == 1 and set(res["counts"]) == {"m1.thunk_sequence.txt",
                                                           "m0.thunk_sequence.txt"}
    assert res["head"].startswith("kCommandBuffer")
    assert thunk_summary(str(tmp_path / "none")) == {"files": []}


def test_a_child_past_its_time_is_recorded_not_waited_for(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--model", "tiny", "--points", "2x32", "--variants", "default",
                 "--child-timeout-s", "0.5", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["variants"]["default"]
    assert row["error"].startswith("stopped after") and row["elapsed_s"] < 30
