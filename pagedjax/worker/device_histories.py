"""Penalty histories kept on the device, updated by deltas (thesis §4.6.2, "persistent batch").

The sampler's repetition, frequency and presence penalties read each penalised row's prompt
and output ids as ``[rows, max_model_len]`` arrays (`SamplingMetadata`). Packed on the host,
a step built both every time and shipped them whole: at 256 penalised rows and 32k tokens,
64 MiB a step, where a decoding row adds one id.

Here a sequence's prompt and outputs live in one row of a device array
``[slots, max_model_len]`` (prompt first, then outputs, like the host's buffers in
`InputBatch.histories`), written once and then extended by the ids the host learned since the
last step (`HistorySlots`, host side). A step sends its rows' slot numbers, their prompt and
output lengths and up to one new id per row itself; `DeviceHistories.gather` writes those in
and gathers the step's two ``[rows, width]`` arrays on the device, masking every column past
a row's lengths to -1, so a slot's stale tail (a longer sequence that held it before) is never
read. Speculative rows add their drafts on the gathered copy (``patches``), and async
scheduling's pending tokens are merged afterwards as before
(`ModelRunner.merge_pending_history`).

The copy is a cache of what the host knows: after a failed call `HistorySlots.invalidate`
forgets every slot, so each sequence is written whole again on its next use.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.worker.device_deltas import DeltaArray, apply_writes


class HistorySlots:
    """Host side: which device slot holds which sequence, and how much of it the device has.

    Sequence ids are never reused and a sequence's prompt and outputs only grow (a fork is a
    new sequence), so an entry (slot, prompt length, outputs sent) tells what to send next; a
    sequence whose prompt length changed or whose outputs shrank is written whole again.
    """

    def __init__(self, slots: int, width: int) -> None:
        self.slots, self.width = slots, width
        self._at: dict[int, list[int]] = {}  # seq id -> [slot, prompt len, outputs sent]
        self._free = list(range(slots - 1, -1, -1))
        self.num_full_writes = 0  # sequences written whole: for tests
        self.num_steady_steps = 0  # steps `steady` served: for tests
        # The last keyed step's rows, for the next step of the same key (`steady`):
        # (key, pad_to, rows, their slots, prompt lengths and outputs sent (arrays), output
        # lists, `_at` entries). While it is kept, its "sent" array, not the entries, says
        # what the device holds of those rows: `_settle` writes it back before anything else
        # reads the entries.
        self._steady: tuple | None = None

    def __len__(self) -> int:
        return len(self._at)

    def _settle(self) -> None:
        """Write the kept rows' sent counts back into their entries and drop the keep."""
        st = self._steady
        if st is not None:
            self._steady = None
            for ent, n in zip(st[7], st[5].tolist(), strict=True):
                ent[2] = n

    def release(self, seq_ids: Iterable[int]) -> None:
        """Free the slots of sequences that ended."""
        self._settle()
        for sid in seq_ids:
            ent = self._at.pop(sid, None)
            if ent is not None:
                self._free.append(ent[0])

    def invalidate(self) -> None:
        """The device copy is zeros again: forget every slot."""
        self._steady = None
        self._at.clear()
        self._free = list(range(self.slots - 1, -1, -1))

    def _take(self, seqs: Sequence) -> int:
        if not self._free:  # releases were missed: drop every sequence this step does not use
            keep = {s.seq_id for s in seqs if s is not None}
            self.release([sid for sid in self._at if sid not in keep])
        if not self._free:
            raise RuntimeError(f"a step uses more than {self.slots} penalised sequences")
        return self._free.pop()

    def steady(self, key: object, pad_to: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """`step` for the rows of the last call made with ``key`` (the engine passes a steady
        decode cohort's key: the same sequences in the same rows, `core.steady_decode`), when
        each has at most one output more than the device holds; else None (call `step`).

        Such a step costs no pass over Python entries: the lengths are read in one
        ``map(len, ...)``, the new ids are each list's last, and the slots, prompt lengths and
        write indices are array arithmetic on the kept rows. Every row's growth is checked,
        not assumed, so a cohort step that applied no token (or two) falls back."""
        st = self._steady
        if st is None or st[0] != key or st[1] != pad_to:
            return None
        _key, _pad, rows, slots, p_lens, sent, outs, _ents = st
        n = np.fromiter(map(len, outs), np.int32, len(outs))
        grew = n - sent
        if int(grew.min()) < 0 or int(grew.max()) > 1 or int((p_lens + n).max()) > self.width:
            return None  # `step` handles (and reports) it
        new = np.flatnonzero(grew)
        if len(new) == len(outs):
            val = np.fromiter((o[-1] for o in outs), np.int32, len(outs))
            idx = slots * self.width + p_lens + sent
        else:
            val = np.fromiter((outs[i][-1] for i in new.tolist()), np.int32, len(new))
            idx = (slots * self.width + p_lens + sent)[new]
        st[5][:] = n  # what the device holds once these writes land (`_settle` reads it)
        full_slots = np.zeros(pad_to, np.int32)
        full_p = np.zeros(pad_to, np.int32)
        full_o = np.zeros(pad_to, np.int32)
        full_slots[rows], full_p[rows], full_o[rows] = slots, p_lens, n
        self.num_steady_steps += 1
        return full_slots, full_p, full_o, idx.astype(np.int32), val

    def steady_rows(self, key: object) -> np.ndarray | None:
        """The rows with histories of the last call made with ``key`` (None: no such call
        is kept)."""
        st = self._steady
        return st[2] if st is not None and st[0] == key else None

    def step(self, seqs: Sequence, pad_to: int, key: object = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For sampler rows ``seqs`` (a sequence with ``seq_id``, ``prompt_token_ids`` and
        ``output_token_ids``, or None for a row without histories): each row's (slot, prompt
        length, output length), padded to ``pad_to`` rows of zeros, and the flat (index,
        value) writes that bring the device up to date. Rows of one sequence share its slot.
        ``key``: kept with the rows for `steady` to serve the next call of the same key
        (only when each sequence has a row of its own)."""
        self._settle()
        slots = np.zeros(pad_to, np.int32)
        p_lens = np.zeros(pad_to, np.int32)
        o_lens = np.zeros(pad_to, np.int32)
        idx: list[int] = []
        val: list[int] = []
        w = self.width
        seen: dict[int, tuple[int, int, int]] = {}
        for r, s in enumerate(seqs):
            if s is None:
                continue
            got = seen.get(s.seq_id)
            if got is None:
                prompt, out = s.prompt_token_ids, s.output_token_ids
                p, n = len(prompt), len(out)
                if p + n > w:
                    raise ValueError(f"sequence {s.seq_id} holds {p + n} tokens, past "
                                     f"max_model_len {w}")
                ent = self._at.get(s.seq_id)
                if ent is None or ent[1] != p or ent[2] > n:
                    slot = ent[0] if ent is not None else self._take(seqs)
                    base = slot * w
                    idx.extend(range(base, base + p + n))
                    val.extend(prompt)
                    val.extend(out)
                    self._at[s.seq_id] = [slot, p, n]
                    self.num_full_writes += 1
                else:
                    slot, done = ent[0], ent[2]
                    if n > done:
                        base = slot * w + p
                        idx.extend(range(base + done, base + n))
                        val.extend(out[done:n])
                        ent[2] = n
                got = seen[s.seq_id] = (slot, p, n)
            slots[r], p_lens[r], o_lens[r] = got
        if key is not None:
            rows = [r for r, s in enumerate(seqs) if s is not None]
            if rows and len(seen) == len(rows):
                at = self._at
                self._steady = (
                    key, pad_to, np.asarray(rows, np.intp), slots[rows], p_lens[rows],
                    o_lens[rows], [seqs[r].output_token_ids for r in rows],
                    [at[seqs[r].seq_id] for r in rows])
        return (slots, p_lens, o_lens, np.asarray(idx, np.int32).reshape(-1),
                np.asarray(val, np.int32).reshape(-1))


def patch_capacity(rows: int, spec_tokens: int) -> int:
    """Draft ids a sampler batch of ``rows`` adds to its gathered histories: a drafted
    sequence's rows 1..k hold 1..k of its drafts, k (k + 1) / 2 over its k + 1 rows, so at most
    rows x k / 2 in all (at least one entry: shapes stay non-empty)."""
    return max(1, rows * spec_tokens // 2)


class DeviceHistories(DeltaArray):
    """Device side: the ``[slots, width]`` rows and the gather a sampler batch calls."""

    def __init__(self, slots: int, width: int, spec_tokens: int, device: jax.Device) -> None:
        super().__init__((slots, width), device, "device penalty histories")
        self.spec_tokens = spec_tokens

    def gather(self, slots: np.ndarray, p_lens: np.ndarray, o_lens: np.ndarray,
               prompt_rows: np.ndarray, idx: np.ndarray, val: np.ndarray,
               patches: Sequence[tuple[int, int, int]] = ()) -> tuple[jax.Array, jax.Array]:
        """The step's (output ids, prompt ids) ``[rows, width]``, -1 past each row's length;
        prompt ids only for rows where ``prompt_rows`` (the repetition penalty's); patches
        (row, column, id) written onto the output ids. Writes past the call's capacity (one
        per row) go ahead in `write` calls."""
        b = len(slots)
        if len(slots) and int(slots.max()) >= self.shape[0]:
            raise RuntimeError(f"history slot {int(slots.max())} is past the device "
                               f"histories' {self.shape[0]} slots")
        step_idx, step_val = self.spill(idx, val, b)
        cap = patch_capacity(b, self.spec_tokens)
        if len(patches) > cap:
            raise RuntimeError(f"{len(patches)} draft ids exceed the histories' {cap}")
        patch = np.zeros((3, cap), np.int32)
        patch[0] = b  # past the last row: dropped
        if patches:
            patch[:, : len(patches)] = np.asarray(patches, np.int32).T
        lens = np.stack([slots, p_lens, np.where(prompt_rows, p_lens, 0), o_lens]).astype(np.int32)
        self.array, out, prompt = self._gather(self.array, step_idx, step_val, lens, patch)
        return out, prompt

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def _gather(self, array, idx, val, lens, patch):
        array = apply_writes(array, idx, val)
        slots, offset, p_len, o_len = lens
        w = array.shape[1]
        rows = array[slots]
        col = jnp.arange(w, dtype=jnp.int32)[None, :]
        prompt = jnp.where(col < p_len[:, None], rows, -1)
        src = jnp.minimum(offset[:, None] + col, w - 1)
        out = jnp.where(col < o_len[:, None], jnp.take_along_axis(rows, src, axis=1), -1)
        out = out.at[patch[0], patch[1]].set(patch[2], mode="drop")
        return array, out, prompt

    def warm(self, batch_sizes: Iterable[int]) -> None:
        """Compile `write` and `gather` for every sampler batch size."""
        super().warm()
        for b in batch_sizes:
            z = np.zeros(b, np.int32)
            jax.block_until_ready(self.gather(z, z, z, np.zeros(b, bool), z[:0], z[:0]))
