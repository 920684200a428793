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

import functools

import jax
import numpy as np

CHUNK = 2048


def capacity(tokens: int, seqs: int, block_size: int) -> int:
    """Table entries a step of this shape carries itself: a block per sequence (a decode
    crossing into a new block) and one per `block_size` tokens (a prefill's new blocks)."""
    return seqs + tokens // block_size


class DeviceTables:
    def __init__(self, rows: int, num_groups: int, width: int, device: jax.Device) -> None:
        self.shape = (rows, num_groups, width)
        self.size = rows * num_groups * width
        if self.size >= 2**31 - 1:
            raise ValueError(f"device block tables of {self.shape} entries overflow int32 "
                             f"indices: lower max_num_seqs or max_model_len")
        self.device = device
        self.array = self._zeros()

    def _zeros(self) -> jax.Array:
        return jax.device_put(np.zeros(self.shape, np.int32), self.device)

    def reset(self) -> None:
        """Zeros again (the old array was lost, or a failed dispatch may have left it behind
        the host rows); the batch must then send every row whole (`InputBatch.invalidate`)."""
        self.array = self._zeros()

    def step_parts(self, rows: np.ndarray, idx: np.ndarray, val: np.ndarray, cap: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, idx, val) for a step carrying ``cap`` entries: writes past ``cap`` are
        applied now (`write`); the step's own are padded with an index past the end, which
        the scatter drops."""
        if len(rows) and int(rows.max()) >= self.shape[0]:
            raise RuntimeError(f"block-table row {int(rows.max())} is past the device "
                               f"table's {self.shape[0]} rows")
        extra = len(idx) - cap
        at = 0
        while extra > 0:  # rare: a long cached prefix, a swap-in, a rebuilt batch
            n = min(CHUNK, extra)
            self.array = self.write(self.array, *self._padded(idx[at:at + n], val[at:at + n],
                                                             CHUNK))
            at += n
            extra -= n
        step_idx, step_val = self._padded(idx[at:], val[at:], cap)
        return rows, step_idx, step_val

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


def gather_rows(array: jax.Array, rows: jax.Array, width: int) -> jax.Array:
    """The step's block tables from the device rows: ``[S, width]``, or ``[G, S, width]``
    for several KV-cache groups (the layout `PagedMeta` takes)."""
    g = array[rows][:, :, :width]
    return g[:, 0] if array.shape[1] == 1 else g.transpose(1, 0, 2)
