"""Block tables kept on the device, updated by deltas (thesis §4.6.2, "persistent batch").

Without it, every step gathers its sequences' block-table rows on the host (`InputBatch`)
and ships the whole ``[S, M]`` array with the step's other inputs. The rows barely change
between steps (a decoding sequence gains a block every `block_size` steps), and on one device
with a fixed table width (`ShapePlan.fixed_width`: M = max_model_len / block_size) that
array is 2 MiB a step at 256 sequences x 32k tokens, whatever the sequences' real lengths.

Here the runner keeps the engine's `InputBatch` rows in a device array
``[rows, G, M]`` (`array`). A step sends the scheduled sequences' row numbers ``[S]`` and the
entries written since the last step (flat index, value: `InputBatch.take_deltas`); the serving
step scatters those in and gathers its rows on the device (`ModelRunner._make_serve_step`),
so the host's cost and the transfer follow what changed. A step carries up to `capacity`
entries itself; more (a new sequence with a long cached prefix, a swap-in) go first in
`CHUNK`-entry calls of `write`, one compiled shape.

The copy is a cache of the host rows, which stay the source of truth. If a dispatch fails
after the queue was taken, the runner starts the copy from zeros and the batch sends every row
whole on its next use (`InputBatch.invalidate`); kernels read only the entries below a
sequence's length, so rows of other or finished sequences are never read.
"""

from __future__ import annotations

import jax
import numpy as np

from pagedjax.worker.device_deltas import CHUNK, DeltaArray, apply_writes

__all__ = ["CHUNK", "DeviceTables", "apply_writes", "capacity", "gather_rows"]


def capacity(tokens: int, seqs: int, block_size: int) -> int:
    """Table entries a step of this shape carries itself: a block per sequence (a decode
    crossing into a new block) and one per `block_size` tokens (a prefill's new blocks)."""
    return seqs + tokens // block_size


class DeviceTables(DeltaArray):
    def __init__(self, rows: int, num_groups: int, width: int, device: jax.Device) -> None:
        super().__init__((rows, num_groups, width), device, "device block tables")

    def step_parts(self, rows: np.ndarray, idx: np.ndarray, val: np.ndarray, cap: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, idx, val) for a step carrying ``cap`` entries (`DeltaArray.spill`)."""
        if len(rows) and int(rows.max()) >= self.shape[0]:
            raise RuntimeError(f"block-table row {int(rows.max())} is past the device "
                               f"table's {self.shape[0]} rows")
        return (rows, *self.spill(idx, val, cap))


def gather_rows(array: jax.Array, rows: jax.Array, width: int) -> jax.Array:
    """The step's block tables from the device rows: ``[S, width]``, or ``[G, S, width]``
    for several KV-cache groups (the layout `PagedMeta` takes)."""
    g = array[rows][:, :, :width]
    return g[:, 0] if array.shape[1] == 1 else g.transpose(1, 0, 2)
