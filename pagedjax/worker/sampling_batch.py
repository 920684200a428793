"""Sampling parameters kept per sequence across steps (the sampling half of the persistent
batch, thesis §4.6.2; `input_batch.InputBatch` keeps the block tables and histories).

A row's temperature, filters, seed, random stream and penalties are fixed by its request and
its index in the request, yet `SamplingMetadata.from_params` rebuilt them row by row every
step: at 256 rows of mixed requests ~0.2-0.3 ms of host time per step. `SamplingBatch` writes
them once, into a slot per (sequence, sample index), and a step gathers its rows' slots with
one index array per column. What changes per step (the number of tokens generated, whether a
row is still short of `min_tokens`) is computed from the rows themselves; histories, masks,
biases and bans go through the same assembly as before (`SamplingMetadata.assemble`), so the
result equals `from_params` field for field (`tests/engine/test_sampling_batch.py`).

Slots are released with their sequences (`release`); those it never hears about (a dropped
beam) are swept when it holds `max_slots`. Sequence ids are never reused, so a stale slot can
never be read for another sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pagedjax.sampler import (
    SamplingMetadata,
    SeqStateLike,
    min_tokens_bans,
    param_columns,
    row_params,
)
from pagedjax.sampling_params import SamplingParams


class SamplingBatch:
    """Per-(sequence, sample index) sampling parameters in column arrays, grown by doubling."""

    def __init__(self, vocab_size: int, max_slots: int, *, eos_token_ids: Sequence[int] = (),
                 engine_seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.eos_token_ids = list(eos_token_ids)
        self.engine_seed = engine_seed
        self._columns = param_columns(vocab_size)
        self._cols = {name: np.full(16, pad, dtype) for name, dtype, pad in self._columns}
        self._penalised = np.zeros(16, bool)
        self._biased = np.zeros(16, bool)
        self._min_tokens = np.zeros(16, np.int64)
        self._slot: dict[tuple[int, int], int] = {}  # (seq id, sample index) -> slot
        self._keys: dict[int, list[tuple[int, int]]] = {}  # seq id -> its keys
        self._free = list(range(15, -1, -1))
        self._count = 0  # slots in use
        self.num_writes = 0  # slots written (each a row's first step): for tests

    def __len__(self) -> int:
        return self._count

    def _grow(self) -> None:
        old = len(self._penalised)
        new = 2 * old

        def grown(a: np.ndarray, pad) -> np.ndarray:
            out = np.full(new, pad, a.dtype)
            out[:old] = a
            return out

        self._cols = {name: grown(self._cols[name], pad) for name, _, pad in self._columns}
        self._penalised = grown(self._penalised, False)
        self._biased = grown(self._biased, False)
        self._min_tokens = grown(self._min_tokens, 0)
        self._free.extend(range(new - 1, old - 1, -1))

    def _write(self, seq_id: int, index: int, p: SamplingParams, s: SeqStateLike) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[seq_id, index] = slot
        self._keys.setdefault(seq_id, []).append((seq_id, index))
        for (name, _, _), x in zip(self._columns, row_params(p, s, self.vocab_size),
                                   strict=True):
            self._cols[name][slot] = x
        self._penalised[slot] = p.uses_penalties
        self._biased[slot] = bool(p.logit_bias)
        self._min_tokens[slot] = p.min_tokens
        self._count += 1
        self.num_writes += 1
        return slot

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the slots of sequences that ended (finished, aborted, dropped)."""
        for sid in seq_ids:
            for key in self._keys.pop(sid, ()):
                self._free.append(self._slot.pop(key))
                self._count -= 1

    def metadata(self, rows: Sequence[tuple[SamplingParams, SeqStateLike]],
                 keys: Sequence[tuple[int, int]], pad_to: int, **assemble) -> SamplingMetadata:
        """`SamplingMetadata.from_params(rows, pad_to, ...)` for rows whose ``keys`` are
        (sequence id, sample index); ``assemble``: `SamplingMetadata.assemble`'s keywords."""
        n, b, v = len(rows), pad_to, self.vocab_size
        if n > b:
            raise ValueError(f"pad_to={b} is smaller than the batch ({n} rows).")
        if len(self) + n > self.max_slots:  # releases were missed: start over, keep this step
            keep = {sid for sid, _ in keys}
            self.release([sid for sid in self._keys if sid not in keep])
        get = self._slot.get
        slots = [get(k) for k in keys]
        if None in slots:  # a row's first step: write its slot
            for i, ((p, s), k) in enumerate(zip(rows, keys, strict=True)):
                if slots[i] is None:
                    slots[i] = self._slot.get(k)
                    if slots[i] is None:
                        slots[i] = self._write(k[0], k[1], p, s)
        idx = np.array(slots, np.intp)
        cols = {}
        for name, dtype, pad in self._columns:
            col = np.full(b, pad, dtype)
            col[:n] = self._cols[name][idx]
            cols[name] = col
        step = np.zeros(b, np.int32)
        step[:n] = [len(s.output_token_ids) + getattr(s, "num_pending", 0) for _, s in rows]
        short = np.flatnonzero(step[:n] < self._min_tokens[idx]).tolist()
        banned = {i: min_tokens_bans(rows[i][0], None, self.eos_token_ids) for i in short}
        return SamplingMetadata.assemble(
            rows, b, v, cols, step, np.flatnonzero(self._penalised[idx]).tolist(),
            np.flatnonzero(self._biased[idx]).tolist(), banned, engine_seed=self.engine_seed,
            **assemble)
