"""A device array kept as a copy of host rows and updated by deltas (thesis §4.6.2).

The persistent batch keeps two such copies on the device: the block tables
(`worker.device_tables`) and the penalty histories (`worker.device_histories`). Both send a
step's changes as (flat index, value) pairs: the step's own call carries up to a fixed number
of them, so its shape never depends on what changed, and more (a long cached prefix, a new
sequence's long prompt) go first in `CHUNK`-entry calls of `write`, one compiled shape.

The copy is a cache: whoever keeps the host rows resets it to zeros after a failed call that
may have taken the donated array with it, and sends every row whole on its next use.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

CHUNK = 2048


class DeltaArray:
    """An int32 device array of ``shape`` (``what`` names it in errors)."""

    def __init__(self, shape: tuple[int, ...], device: jax.Device, what: str) -> None:
        self.shape = shape
        self.size = int(np.prod(shape))
        if self.size >= 2**31 - 1:
            raise ValueError(f"{what} of {shape} entries overflow int32 indices: lower "
                             f"max_num_seqs or max_model_len")
        self.device = device
        self.array = self._zeros()

    def _zeros(self) -> jax.Array:
        return jax.device_put(np.zeros(self.shape, np.int32), self.device)

    def reset(self) -> None:
        """Zeros again (the old array was lost, or a failed call may have left it behind the
        host rows); the host side must then send every row whole."""
        self.array = self._zeros()

    def spill(self, idx: np.ndarray, val: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """(idx, val) for a call carrying ``cap`` entries: writes past ``cap`` are applied
        now (`write`); the call's own are padded with an index past the end, which the
        scatter drops."""
        extra = len(idx) - cap
        at = 0
        while extra > 0:  # rare: a long cached prefix, a swap-in, a long new prompt
            n = min(CHUNK, extra)
            self.array = self.write(self.array, *self._padded(idx[at:at + n], val[at:at + n],
                                                             CHUNK))
            at += n
            extra -= n
        return self._padded(idx[at:], val[at:], cap)

    def _padded(self, idx: np.ndarray, val: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        out_i = np.full(n, self.size, np.int32)
        out_v = np.zeros(n, np.int32)
        out_i[: len(idx)] = idx
        out_v[: len(val)] = val
        return out_i, out_v

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def write(self, array: jax.Array, idx: jax.Array, val: jax.Array) -> jax.Array:
        return apply_writes(array, idx, val)

    def warm(self) -> None:
        """Compile `write` (its one shape)."""
        self.array = self.write(self.array, *self._padded(np.zeros(0, np.int32),
                                                          np.zeros(0, np.int32), CHUNK))


def apply_writes(array: jax.Array, idx: jax.Array, val: jax.Array) -> jax.Array:
    """``array`` with ``val`` written at flat positions ``idx`` (those past the end dropped)."""
    return array.reshape(-1).at[idx].set(val, mode="drop").reshape(array.shape)
