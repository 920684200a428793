"""The Mosaic GPU decode kernel compiles for H100 (sm_90a) in every configuration it
accepts, with no failure, no spill and its SMEM within the limit, and the committed report
(bench/results/aot-h100/mosaic.json) is what the code compiles today
(`JAX_PLATFORMS=cpu .venv-aot/bin/python -m pagedjax.aot.mosaic --write` rebuilds it)."""

from __future__ import annotations

import json

from pagedjax.aot import mosaic


def test_mosaic_kernels_compile_clean_and_match_committed_report():
    fresh = mosaic.build()
    s = fresh["summary"]
    assert s["configs"] == len(mosaic.configs()) == 16
    assert s["failures"] == [] and s["spilling"] == [] and s["over_smem"] == []
    assert s["no_ptxas_report"] == []  # every row parsed a register count
    assert 0 < s["max_registers"] <= 255
    committed = json.loads(mosaic.report_path().read_text())
    strip = lambda rows: [{k: v for k, v in r.items() if k != "compile_s"} for r in rows]  # noqa: E731
    assert strip(committed["rows"]) == strip(fresh["rows"]), (
        f"{mosaic.report_path()} is stale: rebuild it (see this module's docstring)")


def test_engine_decode_step_compiles_with_mosaic_for_h100(monkeypatch):
    """The whole bf16 engine step (layers under the scan) lowers and compiles for H100 with
    PAGEDJAX_PALLAS_LOWERING=mosaic, and its decode attention is no longer a Triton kernel."""
    from pagedjax.aot.step import compile_step, step_shapes
    from pallas_kernels.backend import ENV_LOWERING

    shapes = [s for s in step_shapes(4096) if s.name == "decode_b64"]
    monkeypatch.setenv(ENV_LOWERING, "triton")
    (triton,) = compile_step("smollm2-135m", "h100", shapes=shapes, log=lambda *_: None)
    monkeypatch.setenv(ENV_LOWERING, "mosaic")
    (mosaic,) = compile_step("smollm2-135m", "h100", shapes=shapes, log=lambda *_: None)
    assert triton["error"] is None and mosaic["error"] is None
    assert any(n.startswith("paged_decode") for n in triton["attention_kernels"])
    assert not any(n.startswith("paged_decode") for n in mosaic["attention_kernels"])
    assert mosaic["spilling"] == []
