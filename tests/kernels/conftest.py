"""Kernel-test fixtures shared by every file here."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _native_cpu_cases_need_a_cpu_target(request):
    """``backend="cpu"`` cases test the native XLA:CPU kernel, which has no GPU implementation
    (``resolve_backend`` refuses it there by name). On a GPU host they are skipped, and the GPU
    suite reports the skips; CI, on CPU, runs them."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "cpu":
        from pallas_kernels.backend import target_platform

        if target_platform() != "cpu":
            pytest.skip(f"native CPU kernel case on a {target_platform()} host (CI runs it)")


@pytest.fixture(autouse=True)
def _triton_unless_a_test_says(monkeypatch):
    """The Pallas cases here test the Triton kernels; on a Hopper the default lowering is now
    Mosaic (`pallas_lowering`, "auto"), which would quietly swap them out. The Mosaic tests ask
    for it themselves (``monkeypatch.setenv(ENV_LOWERING, "mosaic")`` or a direct call), and the
    GPU suite's e2e stage runs the engine on the default."""
    from pallas_kernels.backend import ENV_LOWERING

    monkeypatch.setenv(ENV_LOWERING, "triton")
