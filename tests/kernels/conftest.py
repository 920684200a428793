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
