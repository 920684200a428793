"""Deterministic synthetic weights, reproducible from a tensor's name alone (numpy only).

The family parity goldens (`tools/make_family_goldens.py`, `tests/model/test_families.py`)
need the same random weights on both sides of the comparison: HF transformers with torch in
one environment, pagedjax without torch in another. Each tensor is drawn from a generator
seeded by its name and shape, so the goldens file only has to list names and shapes, not
carry megabytes of weights.
"""

from __future__ import annotations

import zlib

import numpy as np


def tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """float32 values for one tensor: norms near their neutral value, biases and matrices
    scaled so activations neither vanish nor blow up through a few random layers."""
    rng = np.random.default_rng([seed, zlib.crc32(f"{name}:{shape}".encode())])
    shape = tuple(int(d) for d in shape)
    if "norm" in name:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def tensors(names_shapes: dict[str, list[int]], seed: int = 0, gemma: bool = False
            ) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint. Non-Gemma norms multiply by their weight, so 1 is added
    (Gemma's multiply by ``1 + w`` already)."""
    out = {}
    for name, shape in names_shapes.items():
        arr = tensor(name, tuple(shape), seed)
        if "norm" in name and not gemma:
            arr = arr + np.float32(1.0)
        out[name] = arr
    return out
