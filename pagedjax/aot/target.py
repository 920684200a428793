"""Compile-only GPU targets: the shipped ``GpuTargetConfig`` text protos and their devices."""

from __future__ import annotations

import functools
import re
from pathlib import Path

TARGETS_DIR = Path(__file__).parent / "targets"
# Targets the compile tier must pass; b200 is attempted and reported when XLA accepts it.
REQUIRED_TARGETS = ("h100", "a100")
ALL_TARGETS = ("h100", "a100", "b200")


def target_config(name: str) -> str:
    path = TARGETS_DIR / f"{name}.txtpb"
    if not path.exists():
        raise ValueError(f"unknown AOT target {name!r}; expected one of {ALL_TARGETS}")
    return path.read_text()


@functools.cache
def compile_only_devices(name: str, num_devices: int = 1) -> tuple:
    """``num_devices`` compile-only GPUs of target ``name`` on one host (for TP meshes)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", topology=f"1x1x{num_devices}", target_config=target_config(name))
    devices = tuple(topo.devices)
    if len(devices) != num_devices:
        raise RuntimeError(f"topology 1x1x{num_devices} gave {len(devices)} devices")
    return devices


def sm_version(name: str) -> str:
    """``sm_90a``-style name of the target's compute capability (as ptxas reports it)."""
    m = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?",
                  target_config(name))
    if m is None:
        raise ValueError(f"target {name!r} names no cuda_compute_capability")
    major, minor = int(m.group(1)), int(m.group(2) or 0)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
