"""The ptxas/thunk report parsers on real log text, and the gate's teeth: a configuration
that spills or overflows shared memory must be reported, not pass silently."""

from __future__ import annotations

from pagedjax.aot import report
from pagedjax.aot.kernel_sweep import KernelCase, compile_case
from pagedjax.aot.resources import parse_ptxas_log, parse_thunks
from pallas_kernels.tuning import KernelTuning

LOG = """\
I1123 nvjitlink.cc:273] libnvjitlink info log output: ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'paged_decode_g16_c1x256' for 'sm_90a'
ptxas info    : Function properties for paged_decode_g16_c1x256
ptxas         .     24 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 63.780 ms
info    : 0 bytes gmem
info    : Function properties for 'paged_decode_g16_c1x256':
info    : used 255 registers, used 1 barriers, 24 stack, 1024 bytes smem, 600 bytes cmem[0], 24 bytes lmem
ptxas info    : Compiling entry function 'loop_pad_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_pad_fusion
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
"""
THUNKS = (
    "001: kCustomKernel [source       | next=003 (2)] loop_pad_fusion grid: [3, 1, 1] "
    "threads: [128, 1, 1]  shared_memory: 0 bytes\n"
    "003: kCustomKernel [prev=002 (1) | next=004 (1)] paged_decode_g16_c1x256 "
    "grid: [4, 8, 9] threads: [128, 1, 1]  shared_memory: 55296 bytes\n"
)


def test_parse_ptxas_log_and_thunks():
    res = parse_ptxas_log(LOG)
    k = res["paged_decode_g16_c1x256"]
    assert (k.registers, k.spill_stores, k.spill_loads, k.stack_bytes) == (255, 24, 20, 24)
    assert (k.static_smem, k.local_bytes) == (1024, 24)
    assert res["loop_pad_fusion"].registers == 10 and res["loop_pad_fusion"].spills == 0
    th = parse_thunks(THUNKS)
    assert th["paged_decode_g16_c1x256"] == ((4, 8, 9), 128, 55296)
    assert th["loop_pad_fusion"] == ((3, 1, 1), 128, 0)


def _report_of(case: KernelCase) -> dict:
    entry = dict(key=list(case.key("sm90")), **compile_case(case, "h100", "sm90"))
    rep = dict(target="h100", smem_limit=report.smem_limit("h100"),
               kernels=dict(configs=[], compiled=[entry]))
    rep["summary"] = report.summarize(rep)
    return rep


def test_spilling_configuration_fails_the_gate():
    # fp32 exact dots with a 64-token chunk on 4 warps: measured to spill ~1 KiB on sm_90a.
    case = KernelCase("decode", "float32", 128, 16, 8, KernelTuning(4, 2, 64))
    bad = report.problems(_report_of(case))
    assert any(line.startswith("spills: paged_decode") for line in bad), bad


def test_shared_memory_overflow_fails_the_gate():
    # 256-token bf16 chunks at head_dim 256, 3 stages: K+V tiles alone need 768 KiB.
    case = KernelCase("ragged", "bfloat16", 256, 256, 1, KernelTuning(4, 3, 256, 64))
    rep = _report_of(case)
    bad = report.problems(rep)
    assert bad and all(line.startswith(("compile failed", "shared memory", "spills"))
                       for line in bad), bad
    errors = [r["error"] for c in rep["kernels"]["compiled"] for r in c["rows"] if r["error"]]
    assert not errors or any("hared memory" in e or "RESOURCE_EXHAUSTED" in e for e in errors)
