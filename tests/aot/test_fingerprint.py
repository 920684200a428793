"""The IR digests the compile tier's check rests on (`pagedjax.aot.fingerprint`): blind to
where the source sits, not blind to what the kernel does or how it launches; and the check's
comparison (`report.verify`'s projection) reports a stale row whether or not it is in the
compiled sample, and reuse takes a committed entry only when its IR matches."""

from __future__ import annotations

import copy
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import SingleDeviceSharding

from pagedjax.aot import fingerprint, report, step
from pagedjax.aot.kernel_sweep import KernelCase, compile_case
from pagedjax.aot.target import compile_only_devices
from pallas_kernels.backend import triton_params
from pallas_kernels.tuning import KernelTuning

fingerprint.strip_locations()

KERNEL_SRC = '''
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + {bias}
'''


def _digest(src: str, filename: str, pad_lines: int = 0, num_warps: int = 4) -> str:
    """Lower a small Pallas-Triton kernel whose source is ``src`` in file ``filename``,
    ``pad_lines`` lines down, for a compile-only H100."""
    scope: dict = {}
    exec(compile("\n" * pad_lines + src, filename, "exec"), scope)
    device = compile_only_devices("h100")[0]
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32, sharding=SingleDeviceSharding(device))
    call = pl.pallas_call(scope["kernel"], out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                          compiler_params=triton_params(num_warps=num_warps))
    with jax.default_device(device):
        return fingerprint.digest(jax.jit(call).lower(x))


def test_digest_ignores_where_the_source_sits():
    src = KERNEL_SRC.format(bias="1.0")
    a = _digest(src, "/work/main/pallas_kernels/k.py")
    assert a == _digest(src, "/check/elsewhere/pallas_kernels/k.py", pad_lines=37)


def test_digest_sees_the_kernel_and_its_launch():
    base = _digest(KERNEL_SRC.format(bias="1.0"), "k.py")
    assert base != _digest(KERNEL_SRC.format(bias="2.0"), "k.py")
    assert base != _digest(KERNEL_SRC.format(bias="1.0"), "k.py", num_warps=8)


def test_sweep_digest_follows_the_tuning_the_engine_gets():
    a = compile_case(KernelCase("decode", "bfloat16", 128, 16, 4), "h100", "sm90", compile=False)
    b = compile_case(KernelCase("decode", "bfloat16", 128, 16, 4, KernelTuning(8, 2, 64)),
                     "h100", "sm90", compile=False)
    (ra,), (rb,) = a["rows"], b["rows"]
    assert ra["kernels"] is None and ra["ir"] and ra["error"] is None
    assert ra["ir"] != rb["ir"]


@functools.cache
def _entry() -> dict:
    case = KernelCase("write_kv", "bfloat16", 64, 16)
    return dict(key=list(case.key("sm90")), **compile_case(case, "h100", "sm90"))


def test_reuse_takes_a_committed_row_only_when_its_ir_matches():
    case = KernelCase("write_kv", "bfloat16", 64, 16)
    entry = _entry()
    (row,) = entry["rows"]
    assert row["kernels"] and row["error"] is None
    # A committed row with the same IR but marked resources: taken as it is, not compiled.
    marked = copy.deepcopy(entry)
    marked["rows"][0]["kernels"][0]["registers"] = 1234
    (got,) = compile_case(case, "h100", "sm90", compile=False, previous=marked)["rows"]
    assert got["kernels"][0]["registers"] == 1234 and got.get("reused")
    # Another IR: not taken; lowered only (compile=False) or compiled afresh.
    marked["rows"][0]["ir"] = "0" * 16
    (got,) = compile_case(case, "h100", "sm90", compile=False, previous=marked)["rows"]
    assert got["kernels"] is None and not got.get("reused")
    (got,) = compile_case(case, "h100", "sm90", previous=marked)["rows"]
    assert got["kernels"] == row["kernels"]


def _reports() -> tuple[dict, dict]:
    """A committed report of two compiled entries and a step, and the fresh check of it
    that compiled only the first entry and lowered the rest."""
    entry = _entry()
    other = copy.deepcopy(entry)
    other["key"], other["rows"][0]["ir"] = ["write_kv", "float16", 64, 16], "f" * 16
    step_row = dict(model="m", tp=1, shape="decode_b1", ir="a" * 16, sampler_ir="b" * 16,
                    error=None, compile_s=1.0, sampler_compile_s=1.0, temp_mib=3.0, kernels=9,
                    max_registers=100, spilling=[], max_smem=0, attention_kernels=["x"],
                    sampler_rows=1, sampler_error=None, sampler_spilling=[])
    committed = dict(target="h100", versions={"jax": "1"}, target_config_sha="c",
                     kernels=dict(configs=[{"compiled": 0}, {"compiled": 1}],
                                  compiled=[entry, other]), steps=[step_row])
    fresh = copy.deepcopy(committed)
    fresh["kernels"]["compiled"][1]["rows"][0]["kernels"] = None
    fresh["steps"][0].update(dict.fromkeys(step.STEP_COMPILE_FIELDS))
    return committed, fresh


def _diffs(committed: dict, fresh: dict) -> list[str]:
    return report.differences(report.project(committed, fresh), fresh)


def test_check_passes_an_unchanged_report():
    committed, fresh = _reports()
    assert _diffs(committed, fresh) == []


@pytest.mark.parametrize("change", ["sampled_resources", "lowered_ir", "step_ir", "sampler_ir",
                                    "configs"])
def test_check_reports_every_kind_of_stale_row(change):
    committed, fresh = _reports()
    if change == "sampled_resources":  # a compiled entry whose registers moved
        fresh["kernels"]["compiled"][0]["rows"][0]["kernels"][0]["registers"] += 1
    elif change == "lowered_ir":  # an entry outside the sample whose kernel changed
        fresh["kernels"]["compiled"][1]["rows"][0]["ir"] = "e" * 16
    elif change == "step_ir":
        fresh["steps"][0]["ir"] = "d" * 16
    elif change == "sampler_ir":
        fresh["steps"][0]["sampler_ir"] = "d" * 16
    else:  # the tuning table now maps a configuration to another kernel
        fresh["kernels"]["configs"][0]["compiled"] = 1
    assert _diffs(committed, fresh)


def test_check_reports_a_changed_toolchain():
    committed, fresh = _reports()
    assert report.toolchain_changes(committed, fresh) == []
    fresh["versions"]["jax"] = "2"
    fresh["target_config_sha"] = "d"
    changes = report.toolchain_changes(committed, fresh)
    assert len(changes) == 2 and "jax 1 -> 2" in changes[0]


def test_sample_takes_the_kernels_nearest_the_limits():
    committed = report.load("h100")
    sample = report.kernel_sample(committed)
    compiled = committed["kernels"]["compiled"]
    regs = max(k["registers"] for c in compiled for r in c["rows"] for k in r["kernels"])
    assert any(k["registers"] == regs for c in compiled if tuple(c["key"]) in sample
               for r in c["rows"] for k in r["kernels"])
    assert len(compiled) // report.SAMPLE_STRIDE <= len(sample) <= len(compiled) // 10


def test_mosaic_lowering_carries_no_source_file():
    """Mosaic GPU stamps its ops with the innermost user frame (not the traceback limit's
    business): the digest would follow every edit above a Mosaic kernel without the hook."""
    from pallas_kernels.mosaic_decode_attention import mosaic_paged_decode

    device = compile_only_devices("h100")[0]
    S = functools.partial(jax.ShapeDtypeStruct, sharding=SingleDeviceSharding(device))
    cache = S((2, 8, 64, 16, 128), jnp.bfloat16)
    i32 = jnp.int32
    with jax.default_device(device):
        lowered = jax.jit(lambda *a: mosaic_paged_decode(*a, scale=0.1)).lower(
            S((8, 32, 128), jnp.bfloat16), cache, cache, S((8, 64), i32), S((8,), i32),
            S((), i32), S((), i32))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and ".py" not in text


def test_mosaic_check_reports_a_changed_row_in_or_out_of_the_sample():
    from pagedjax.aot import mosaic

    committed = json.loads(mosaic.report_path().read_text())
    rows = committed["rows"]
    picked = mosaic.sample(committed)
    out = next(i for i in range(len(rows)) if i not in picked)
    inside = min(picked)

    def check(i=None, **change):
        fresh = [dict(r, compile_s=1.0) if j in picked else
                 dict(r, registers=None, spill_bytes=None) for j, r in enumerate(rows)]
        if i is not None:
            fresh[i] = dict(fresh[i], **change)
        return mosaic.compare(rows, fresh, picked)

    assert check() == []
    assert check(out, ir="0" * 16)  # a kernel outside the sample changed
    assert check(inside, registers=(rows[inside]["registers"] or 0) + 8)  # compiled: moved
    assert check(inside, error="RuntimeError: x")
    assert mosaic.compare(rows, rows[:-1], picked)
