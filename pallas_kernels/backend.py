"""Backend selection for the paged-cache kernels.

Every public kernel takes ``backend``: ``"pallas"`` runs the Pallas kernel (Triton-lowered
when the target is a GPU, ``interpret=True`` otherwise), ``"xla"`` runs the pure-jnp
reference, and ``"cpu"`` runs the native XLA:CPU attention kernel (`cpu_native`; the cache
ops have no native variant and take the XLA path). ``None`` picks automatically: Pallas on
GPU; on CPU the native kernel when it builds, else XLA (interpreting a Pallas kernel is far
slower than either). ``PAGEDJAX_ATTENTION_BACKEND`` overrides the automatic choice (an
explicit argument still wins).

Whether Pallas interprets is decided from the *lowering target*, not from the installed
devices: under ``jax.sharding.use_abstract_mesh`` with an abstract CUDA device the kernels
lower through Triton even on a CPU-only host, which is how the CUDA-lowering tests work.
``PAGEDJAX_PALLAS_INTERPRET=0/1`` forces the choice.
"""

from __future__ import annotations

import os
from typing import Literal

import jax
from jax._src import mesh as mesh_lib

Backend = Literal["pallas", "xla", "cpu"]
BACKENDS: tuple[str, ...] = ("pallas", "xla", "cpu")
ENV_BACKEND = "PAGEDJAX_ATTENTION_BACKEND"
ENV_INTERPRET = "PAGEDJAX_PALLAS_INTERPRET"
# Which Pallas GPU lowering runs the attention kernels. Triton is the portable path (Ampere
# and up; deprecated upstream since jax 0.11 but shipped through 0.12); "mosaic" runs the
# Mosaic GPU kernels (Hopper: TMA, wgmma; `pallas_kernels.mosaic_decode_attention`,
# `mosaic_ragged_attention`) where they cover the call, Triton elsewhere. "auto", the
# default, is Mosaic on a GPU that says it is a Hopper (compute capability 9.x) and Triton
# everywhere else. Why Mosaic there: on the H200 (stop 52) the whole Llama-3-8B decode step
# took 0.97x Triton's time at batch 64 x 1024 and 0.89x at 32 x 4096, and every golden passed
# under it (docs/gpu.md). A deviceless compile target (the AOT tier's H100) is no device of
# this process, so it keeps Triton unless asked (`target_compute_capability`).
ENV_LOWERING = "PAGEDJAX_PALLAS_LOWERING"
LOWERINGS: tuple[str, ...] = ("auto", "triton", "mosaic")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def target_platform() -> str:
    """Platform the current trace lowers for.

    An abstract mesh's device wins, then a ``jax.default_device`` context (how the
    deviceless AOT tier targets a compile-only H100 from a CPU host), then the default backend.
    """
    abstract_device = mesh_lib.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.platform
    default = jax.config.jax_default_device
    if default is not None:
        return default if isinstance(default, str) else default.platform
    return jax.default_backend()


def is_gpu_target() -> bool:
    return target_platform() in _GPU_PLATFORMS


def resolve_backend(backend: str | None) -> Backend:
    """Explicit argument, then the env override, then Pallas on GPU / native or XLA on CPU."""
    choice = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    if choice is None:
        if is_gpu_target():
            return "pallas"
        return "cpu" if target_platform() == "cpu" and native_cpu_available() else "xla"
    choice = choice.lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}; expected one of {BACKENDS}")
    if choice == "cpu" and target_platform() != "cpu":
        # The native kernel is an XLA:CPU custom call: on a GPU it has no implementation, and
        # the first H100 run showed it failing deep inside the compile instead of saying so.
        raise ValueError(f"attention backend 'cpu' runs the native XLA:CPU kernel, but this "
                         f"computation lowers for {target_platform()!r}; use 'pallas' or 'xla'")
    if choice == "cpu" and not native_cpu_available():
        raise ValueError("attention backend 'cpu': the native CPU kernel is unavailable "
                         "(no C++ compiler, or PAGEDJAX_NATIVE_CPU=0); use 'xla'")
    return choice  # type: ignore[return-value]


def native_cpu_available() -> bool:
    from pallas_kernels import cpu_native

    return cpu_native.available()


def uses_pallas(backend: str | None) -> bool:
    """Whether the cache ops (write_kv, copy_blocks) run their Pallas kernel."""
    return resolve_backend(backend) == "pallas"


def cost_follows_length(backend: str | None) -> bool:
    """Whether attention's cost follows each sequence's real length (Pallas and native CPU
    kernels) rather than the padded block-table width (the XLA path gathers all of it)."""
    return resolve_backend(backend) in ("pallas", "cpu")


def interpret_mode() -> bool:
    """Run Pallas kernels in the interpreter unless lowering for a GPU."""
    forced = os.environ.get(ENV_INTERPRET)
    if forced is not None and forced != "":
        return forced not in ("0", "false", "False")
    return not is_gpu_target()


def pallas_lowering() -> str:
    """The Pallas GPU lowering to use, ``"triton"`` or ``"mosaic"``: ``PAGEDJAX_PALLAS_LOWERING``,
    else ``"auto"`` (`auto_lowering`)."""
    choice = (os.environ.get(ENV_LOWERING) or "auto").lower()
    if choice not in LOWERINGS:
        raise ValueError(f"{ENV_LOWERING}={choice!r}; expected one of {LOWERINGS}")
    if choice != "auto":
        return choice
    if not is_gpu_target() or interpret_mode():
        return "triton"  # the interpreted Mosaic kernels are far slower than Triton's
    from pallas_kernels.mosaic_decode_attention import mosaic_available

    return auto_lowering(target_compute_capability(), mosaic_available())


def auto_lowering(compute_capability: str | None, mosaic_ok: bool) -> str:
    """Mosaic on a GPU known to be a Hopper (9.x) with a jax that has the kernels' API;
    Triton on anything else, an unknown target included."""
    if mosaic_ok and compute_capability is not None and str(compute_capability).startswith("9"):
        return "mosaic"
    return "triton"


def target_device():
    """The device a trace targets: a ``jax.default_device`` context's, else the default
    backend's first; None where there is none."""
    dev = jax.config.jax_default_device
    if dev is None or isinstance(dev, str):
        try:
            return jax.devices()[0]
        except RuntimeError:
            return None
    return dev


def target_compute_capability() -> str | None:
    """The compute capability of this process's GPU the trace targets; None for a CPU and
    for a compile-only target (the AOT tier's deviceless H100 reports 9.0 but is no device of
    this process: its default stays Triton, what its reports and tests pin)."""
    dev = target_device()
    if dev is None:
        return None
    if dev is jax.config.jax_default_device:  # set by a context: maybe compile-only
        try:
            if dev not in jax.local_devices(backend=dev.platform):
                return None
        except RuntimeError:  # no such backend here: a compile-only device
            return None
    cc = getattr(dev, "compute_capability", None)
    return None if cc is None else str(cc)


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler parameters (ignored by the interpreter)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
