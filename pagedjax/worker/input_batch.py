"""The persistent batch (thesis §4.6.2): per-sequence step state kept between steps.

Rebuilding every step's block tables from scratch costs O(blocks) per sequence per step, and
the tables barely change: a decoding sequence gains one block every `block_size` steps.
`InputBatch` keeps one row per sequence, keyed by sequence id, and updates it by deltas:

- a row whose table version (`BlockManager.get_block_table_ref`) is the one it mirrors gets
  only the ids appended since, usually none;
- a new sequence, a copy-on-write replacement, a swap or a recompute (each a new version) gets
  its row rewritten, with the stale tail zeroed, so the row is exactly the table.

A step's `[S, M]` block-table array is then one gather of the scheduled rows.

Penalised requests' token histories (the sampler's repetition / frequency / presence inputs)
are kept the same way: one int32 buffer per sequence holding its prompt and outputs, which a
step extends by the tokens appended since the last (`histories`), so packing a step's
`[rows, max_model_len]` histories copies arrays instead of converting every row's whole token
list each step.

The batch is a cache, never the source of truth: a row is checked against the live table's
version every time it is used, so a missed release or a step that was dropped after
scheduling can cost a rewrite but never a stale block id (a stale id would read another
request's KV).
Rows are released when their sequences end (`release`); if releases are missed, the batch
forgets every row not in the current step once it holds `max_rows`.

A steady decode step (`core.steady_decode`: the last step's lone decoding sequences again)
takes `steady_rows`: the cohort's rows are kept as one array, and only the rows of the
sequences whose slot opened a block this step are checked. The others' tables cannot have
changed: inside a block a cohort's table only changes by a copy-on-write or a swap, and
either changes the running groups, which ends the cohort.

A hybrid model (several KV-cache groups, `core.kv_groups`) keeps one table per group in each
row, `[rows, G, M]`, each mirrored by its own version; the step's array is then `[G, S, M]`.

With ``device_tables`` (the runner keeps a copy of the rows on the device,
`worker.device_tables`), every entry a row update writes is also queued, as (flat index,
value) pairs into the `[max_rows, G, M]` table, and `take_deltas` hands the queue to the step
that is dispatched next: the device then scatters the changes and gathers the step's rows
itself, so what travels per step follows what changed, not S x M (128 KiB at 256 sequences x
128 blocks, 2 MiB at 256 x 2048). The queue is drained at dispatch, not when a step is built,
so a step built and then dropped leaves its changes for the next one; `invalidate` (the device
copy is zeros again) makes every row send all its entries on its next use.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class InputBatch:
    def __init__(self, max_blocks_per_seq: int, max_rows: int = 1024,
                 num_groups: int = 1, device_tables: bool = False) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_rows = max_rows
        self.num_groups = num_groups
        # Queued (flat indices, values) writes for the device copy; None: no device copy.
        self._deltas: list[tuple[np.ndarray, np.ndarray]] | None = [] if device_tables else None
        # (row, group)s the device copy holds as zeros (`invalidate`): their next rewrite
        # sends every entry, not only those that differ from the host row.
        self._zeroed: set[tuple[int, int]] = set()
        self._row: dict[int, int] = {}  # seq id -> row
        self._free: list[int] = []
        self._tables = np.zeros((0, num_groups, max_blocks_per_seq), np.int32)
        # Per row and group: the table version it mirrors (-2: none), table entries written.
        self._version: list[list[int]] = []
        self._written: list[list[int]] = []
        self.num_rewrites = 0  # full-row writes (tests and benchmarks read it)
        # `steady_rows`: the cohort key and its sequences' rows (array, list).
        self._steady: tuple[int, np.ndarray, list[int]] | None = None
        # seq id -> (prompt + outputs buffer, outputs written): penalised sequences only.
        self._hist: dict[int, tuple[np.ndarray, int]] = {}

    @property
    def device_tables(self) -> bool:
        """True when the runner keeps the rows on the device (`take_deltas` feeds it)."""
        return self._deltas is not None

    def __len__(self) -> int:
        return len(self._row)

    def _grow(self) -> None:
        old = len(self._version)
        new = max(16, 2 * old)
        tables = np.zeros((new, self.num_groups, self.max_blocks_per_seq), np.int32)
        tables[:old] = self._tables
        self._tables = tables
        self._version += [[-2] * self.num_groups for _ in range(new - old)]
        self._written += [[0] * self.num_groups for _ in range(new - old)]
        self._free.extend(range(new - 1, old - 1, -1))

    def _assign(self, seq_id: int) -> int:
        if not self._free:
            self._grow()
        r = self._free.pop()
        self._row[seq_id] = r
        self._version[r] = [-2] * self.num_groups
        return r

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the rows of sequences that ended (finished, aborted, dropped beams). The
        steady rows stay: a cohort cut down (`DecodeCohort.without_gone`) keeps only
        sequences still running, whose rows stay theirs."""
        for sid in seq_ids:
            self._hist.pop(sid, None)
            r = self._row.pop(sid, None)
            if r is not None:
                self._version[r] = [-2] * self.num_groups
                self._free.append(r)

    def rows(self, scheduled) -> list[int]:
        """Bring the row of every scheduled sequence up to date; returns the rows in order."""
        if len(self._row) >= self.max_rows:  # releases were missed: start over, keep this step
            keep = {s.seq_id for s in scheduled}
            self.release([sid for sid in self._row if sid not in keep])
            self._hist = {k: v for k, v in self._hist.items() if k in keep}
        row_of = self._row
        groups = self.num_groups
        mirrored, written = self._version, self._written
        out = []
        add = out.append
        if groups == 1:  # one loop of its own: it runs for every sequence of every step
            for s in scheduled:
                r = row_of.get(s.seq_id)
                if r is None:
                    r = self._assign(s.seq_id)
                v = s.table_version
                if v < 0 or mirrored[r][0] != v or len(s.block_table) != written[r][0]:
                    self._update(r, 0, s.block_table, v, s.seq_id)
                add(r)  # else mirrored already: most rows of a decode step
            return out
        for s in scheduled:
            r = row_of.get(s.seq_id)
            if r is None:
                r = self._assign(s.seq_id)
            tables, versions = s.block_table, s.table_version
            if not isinstance(tables, tuple):  # one table for every group
                tables, versions = (tables,) * groups, (-1,) * groups
            for g in range(groups):
                self._update(r, g, tables[g], versions[g], s.seq_id)
            add(r)
        return out

    def steady_rows(self, run, entries) -> np.ndarray:
        """`rows` for a steady run (`core.steady_decode.SteadyRun`; ``entries()``: its
        `ScheduledSeq` entries, read on a cohort's first step): the cohort's rows as an int32
        array, with the rows of the sequences whose slot opened a block brought up to date."""
        cohort = run.cohort
        kept = self._steady
        if kept is None or kept[0] != cohort.key:
            parent = cohort.parent
            if kept is not None and parent is not None and kept[0] == parent[0]:
                idx = parent[1]  # cut down from the cohort kept: its rows, cut the same way
                old = kept[2]
                rows = [old[i] for i in idx]
                kept = self._steady = (cohort.key, kept[1][idx], rows)
            else:
                rows = self.rows(entries())
                kept = self._steady = (cohort.key, np.array(rows, np.int32), rows)
                return kept[1]
        rows = kept[2]
        mirrored, written = self._version, self._written
        # A slot that opened a block appended one block to a row mirrored up to it (the
        # usual case): those rows are written together, one queued delta for all.
        grown_r: list[int] = []
        grown_w: list[int] = []
        grown_b: list[int] = []
        for i, table, v in run.slotted:
            r = rows[i]
            w = written[r][0]
            n = len(table)
            if mirrored[r][0] == v and n == w + 1 and n <= self.max_blocks_per_seq:
                grown_r.append(r)
                grown_w.append(w)
                grown_b.append(table[w])
                written[r][0] = n
            elif mirrored[r][0] != v or n != w:
                self._update(r, 0, table, v, cohort.seqs[i].seq_id)
        if grown_r:
            r_arr = np.array(grown_r, np.int32)
            w_arr = np.array(grown_w, np.int32)
            b_arr = np.array(grown_b, np.int32)
            self._tables[r_arr, 0, w_arr] = b_arr
            if self._deltas is not None:
                self._deltas.append((r_arr * (self.num_groups * self.max_blocks_per_seq)
                                     + w_arr, b_arr))
        return kept[1]

    def _update(self, r: int, g: int, table: list[int], v: int, seq_id: int) -> None:
        n = len(table)
        if n > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq_id}: {n} blocks exceed max_blocks_per_seq="
                             f"{self.max_blocks_per_seq}")
        version, written, row = self._version[r], self._written[r], self._tables[r, g]
        if v < 0 or version[g] != v:  # new, CoW'd, swapped or unknown: the whole row
            old = written[g]
            span = max(old, n)
            before = row[:span].copy() if self._deltas is not None else None
            row[:n] = table
            if old > n:
                row[n:old] = 0
            version[g] = v if v >= 0 else -2
            written[g] = n
            self.num_rewrites += 1
            if self._deltas is not None:
                # The entries that differ from what the device holds (all of them after
                # `invalidate`), the stale tail's zeros included: the device row then equals
                # the host row exactly. An unversioned table that only grew (the contiguous
                # baselines rewrite every step) sends its new entries only.
                base = (r * self.num_groups + g) * self.max_blocks_per_seq
                if (r, g) in self._zeroed:
                    self._zeroed.discard((r, g))
                    changed = np.arange(span, dtype=np.int32)
                else:
                    changed = np.flatnonzero(row[:span] != before).astype(np.int32)
                if changed.size:
                    self._deltas.append((base + changed, row[changed]))
        elif n > written[g]:  # appended blocks only
            w = written[g]
            row[w:n] = table[w:]
            written[g] = n
            if self._deltas is not None:
                base = (r * self.num_groups + g) * self.max_blocks_per_seq
                self._deltas.append((np.arange(base + w, base + n, dtype=np.int32),
                                     row[w:n].copy()))

    def take_deltas(self) -> tuple[np.ndarray, np.ndarray]:
        """The queued writes as (flat indices, values) int32 arrays into `host_tables`'
        ``[max_rows, G, M]`` layout, each index once (the latest value wins), and an empty
        queue after. Only with ``device_tables``."""
        if self._deltas is None:
            raise RuntimeError("take_deltas: this InputBatch keeps no device copy")
        q, self._deltas = self._deltas, []
        if not q:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        idx = np.concatenate([i for i, _ in q])
        val = np.concatenate([v for _, v in q]).astype(np.int32, copy=False)
        if len(q) > 1:  # a row written twice (a dropped step, then this one): keep the last
            last = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
            if len(last) < len(idx):
                last.sort()
                idx, val = idx[last], val[last]
        return idx, val

    def invalidate(self) -> None:
        """The device copy is zeros again (lost and rebuilt, or reset after a failed
        dispatch): every row rewrites itself, queueing all its entries, the next time it is
        used, and the queue is dropped."""
        self._steady = None
        for version in self._version:
            version[:] = [-2] * self.num_groups
        if self._deltas is not None:
            self._deltas = []
            self._zeroed = {(r, g) for r in range(len(self._version))
                            for g in range(self.num_groups)}

    @property
    def host_tables(self) -> np.ndarray:
        """The host rows ``[rows so far, G, M]`` (read-only use: slot mappings, tests)."""
        return self._tables

    def block_tables(self, scheduled, s_pad: int, m_pad: int) -> np.ndarray:
        """The step's `[s_pad, m_pad]` block tables (padding rows and columns 0); hybrid:
        `[G, s_pad, m_pad]`."""
        rows = self.rows(scheduled)
        out = np.zeros((self.num_groups, s_pad, m_pad), np.int32)
        out[:, : len(rows)] = self._tables[rows, :, :m_pad].transpose(1, 0, 2)
        return out[0] if self.num_groups == 1 else out

    def histories(self, seq) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, output ids) of a sequence as int32 arrays (views of its buffer), with
        only the outputs appended since the last call copied in (outputs only ever grow: a fork
        is a new sequence; a buffer that is full or disagrees is rebuilt, twice as large)."""
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        p, n = len(prompt), len(out)
        entry = self._hist.get(seq.seq_id)
        if entry is None or entry[0].shape[0] < p + n or entry[1] > n:
            buf = np.empty(max(2 * (p + n), 64), np.int32)  # room to grow
            buf[:p] = prompt
            done = 0
        else:
            buf, done = entry
        if n > done:
            buf[p + done : p + n] = out[done:]
        self._hist[seq.seq_id] = (buf, n)
        return buf[:p], buf[p : p + n]
