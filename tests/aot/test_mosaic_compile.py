"""The Mosaic GPU decode and ragged kernels compile for H100 (sm_90a) in every configuration
they accept (quantized caches included), with no failure, no spill and their SMEM within
the limit, and the committed report (bench/results/aot-h100/mosaic.json) is what the code
compiles today (`JAX_PLATFORMS=cpu .venv-aot/bin/python -m pagedjax.aot.mosaic --write`
rebuilds it): every configuration lowers to its recorded IR digest and a sample compiles
again to its recorded registers (PAGEDJAX_AOT_FULL=1: all of them)."""

from __future__ import annotations

import json
import os

from pagedjax.aot import mosaic


def test_mosaic_kernels_compile_clean_and_match_committed_report():
    committed = json.loads(mosaic.report_path().read_text())
    s = committed["summary"]
    assert s["configs"] == len(committed["rows"]) == len(mosaic.configs()) == 22 + 50 + 35 + 36
    assert s["failures"] == [] and s["spilling"] == [] and s["over_smem"] == []
    assert s["no_ptxas_report"] == []  # every row parsed a register count
    assert 0 < s["max_registers"] <= 255
    assert all(r["ir"] for r in committed["rows"])
    if os.environ.get("PAGEDJAX_AOT_FULL") == "1":
        fresh = mosaic.build()
        assert fresh["summary"] == s
        diffs = [] if mosaic.stable(fresh["rows"]) == committed["rows"] else ["rows differ"]
    else:
        diffs = mosaic.verify(committed)
    assert not diffs, (f"{mosaic.report_path()} is stale: rebuild it (see this module's "
                       "docstring):\n" + "\n".join(diffs[:12]))


def test_engine_steps_compile_with_mosaic_for_h100(monkeypatch):
    """The whole bf16 engine step (layers unrolled, as on one GPU) lowers and compiles for H100 with
    PAGEDJAX_PALLAS_LOWERING=mosaic, decode and mixed prefill + decode, and its attention is
    no longer a Triton kernel (write_kv still is)."""
    from pagedjax.aot.step import compile_step, step_shapes
    from pallas_kernels.backend import ENV_LOWERING

    shapes = [s for s in step_shapes(4096) if s.name in ("decode_b64", "mixed_512+63")]
    assert len(shapes) == 2
    rows = {}
    for lowering in ("triton", "mosaic"):
        monkeypatch.setenv(ENV_LOWERING, lowering)
        rows[lowering] = compile_step("smollm2-135m", "h100", shapes=shapes,
                                      log=lambda *_: None)
    for tri, mos in zip(rows["triton"], rows["mosaic"], strict=True):
        assert tri["error"] is None and mos["error"] is None
        attn = ("paged_decode", "ragged_paged")
        assert any(n.startswith(attn) for n in tri["attention_kernels"])
        assert not any(n.startswith(attn) for n in mos["attention_kernels"])
        assert any(n.startswith("write_kv") for n in mos["attention_kernels"])
        assert mos["spilling"] == []


def test_tp2_decode_step_compiles_with_mosaic_for_h100(monkeypatch):
    """Tensor parallelism over two H100s with the Mosaic attention (the Hopper default since
    stop 52), not yet run on a GPU: the Llama-3-8B decode step, its heads split per device,
    compiles with no error or spill, and no Triton attention kernel is left in it."""
    from pagedjax.aot.step import compile_step, step_shapes
    from pallas_kernels.backend import ENV_LOWERING

    monkeypatch.setenv(ENV_LOWERING, "mosaic")
    shapes = [s for s in step_shapes(4096) if s.name == "decode_b64"]
    (row,) = compile_step("llama3-8b", "h100", tp=2, shapes=shapes, log=lambda *_: None)
    assert row["error"] is None and row["sampler_error"] is None and row["tp"] == 2
    assert row["spilling"] == [] and row["sampler_spilling"] == []
    assert not any(n.startswith(("paged_decode", "ragged_paged"))
                   for n in row["attention_kernels"])
    assert any(n.startswith("write_kv") for n in row["attention_kernels"])
