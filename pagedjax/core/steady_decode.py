"""Steady decode steps: the same lone decoding sequences as the step before, one token each.

Most steps of a loaded server schedule exactly the running groups of the step before, each a
lone sequence one token further on. `Scheduler._decode_run` schedules each of them with the
general checks and a `ScheduledSeq` per sequence, and every later stage (step inputs, row
lookups, output handling) walks that list again: ~4 µs of Python per sequence per step.
A `DecodeCohort` remembers such a set once. The next step takes `Scheduler._steady_step` if
the running list is the same list of groups, or the same less some that finished or were
aborted (the cohort is then cut down, and so are the caches kept of it): one pass that
re-checks each sequence's counts and status (the general path's own conditions, so a change
anywhere falls back to it) and advances it, and a `SteadyRun` of columns (start positions,
token ids) instead of `ScheduledSeq` entries, which the runner and the engine read as arrays
and per-cohort caches. `SchedulerOutput.scheduled` still lists the entries, made on first
use, for any reader that needs them (and for steps that schedule other groups too).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pagedjax.core.sequence import Sequence, SequenceGroup

_cohort_ids = itertools.count(1)


class DecodeCohort:
    """A step's running groups when every one was a lone decoding sequence (`groups[i]`'s
    sequence is `seqs[i]`), in the step's order. ``tables``: each sequence's live block table
    (the KV manager's list, appended in place); ``layout``: `SequenceGroup.seq_changes` when
    it was made (a fork or a dropped beam changes some group's sequences). ``pending``: the
    tokens each sequence had on the device then (1 with async scheduling, else 0), the same
    for all. ``key``: a fresh int per cohort, for caches of it elsewhere."""

    __slots__ = ("groups", "seqs", "tables", "room", "layout", "pending", "key", "parent",
                 "_request_ids", "_columns")

    def __init__(self, groups: list[SequenceGroup], seqs: list[Sequence], tables: list[list[int]],
                 room: int, pending: int,
                 parent: tuple[int, list[int]] | None = None) -> None:
        self.groups, self.seqs, self.tables = groups, seqs, tables
        self.room, self.pending = room, pending
        self.layout = SequenceGroup.seq_changes
        self.key = next(_cohort_ids)
        # (the key of the cohort this one was cut from, the indices it kept there, in order):
        # caches of that cohort (rows, row info) are cut the same way instead of rebuilt.
        self.parent = parent
        self._request_ids: frozenset[str] | None = None
        self._columns: tuple[list[list[int]], list[int], frozenset[int]] | None = None

    def without_gone(self, running: list[SequenceGroup]) -> DecodeCohort | None:
        """The cohort cut down to ``running`` if that is this cohort's groups with some left
        out (finished, aborted) and none added, in the same order; else None."""
        m = len(running)
        if not m or m >= len(self.groups):
            return None
        kept: list[int] = []
        j = 0
        for i, g in enumerate(self.groups):
            if j < m and running[j] is g:
                kept.append(i)
                j += 1
        return self.cut(kept) if j == m else None

    def cut(self, kept: list[int]) -> DecodeCohort:
        """The cohort of the groups at ``kept`` (indices, in order)."""
        groups, seqs, tables = self.groups, self.seqs, self.tables
        groups = [groups[i] for i in kept]
        c = DecodeCohort(groups, [seqs[i] for i in kept], [tables[i] for i in kept],
                         sum(g.n for g in groups), self.pending, (self.key, kept))
        if self._columns is not None:  # (the stop ids of groups left out only cost a check)
            outs, limits, stop_any = self._columns
            c._columns = [outs[i] for i in kept], [limits[i] for i in kept], stop_any
        return c

    def columns(self) -> tuple[list[list[int]], list[int], frozenset[int]]:
        """What applying a token to each sequence reads (`Scheduler.update_steady`): the
        sequences' output lists (a sequence keeps its list for life), their groups' output
        limits (fixed when a group is added) and every stop id of the groups (EOS included).
        Made once per cohort, cut with it."""
        if self._columns is None:
            self._columns = ([s.output_token_ids for s in self.seqs],
                             [g.output_limit for g in self.groups],
                             frozenset().union(*(g.stops.any_ids for g in self.groups)))
        return self._columns

    @property
    def request_ids(self) -> frozenset[str]:
        if self._request_ids is None:
            self._request_ids = frozenset(g.request_id for g in self.groups)
        return self._request_ids

    def __len__(self) -> int:
        return len(self.seqs)


class SteadyRun:
    """One steady step's share of a cohort: each sequence's start position (its computed
    length before the step) and the token it computes (None: every one pending, async
    scheduling), and ``slotted``: (index, table, version) of the sequences whose slot opened
    a block this step (their table rows changed)."""

    __slots__ = ("cohort", "starts", "token_ids", "slotted", "_entries")

    def __init__(self, cohort: DecodeCohort, starts: list[int], token_ids: list[int] | None,
                 slotted: list[tuple[int, list[int], int]]) -> None:
        self.cohort, self.starts, self.token_ids, self.slotted = cohort, starts, token_ids, slotted
        self._entries: list | None = None

    def entries(self, make: Callable[[SteadyRun], list]) -> list:
        """The run as `ScheduledSeq` entries (made once, by ``make``)."""
        if self._entries is None:
            self._entries = make(self)
        return self._entries
