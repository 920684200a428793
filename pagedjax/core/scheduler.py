"""Iteration-level scheduler: every step schedules Δ tokens per sequence under a token budget.

FCFS (paper §4.5, thesis Alg. 1): running groups first (decodes and unfinished
prefill chunks), then swapped groups, then new admissions; new requests are
not admitted while any group is swapped out or a preemption happened this
step. PRIORITY (vLLM's `--scheduling-policy priority`): FCFS over the key
(request priority, arrival), lower first; swapped and waiting groups are taken in
that one order, and a group that cannot be admitted preempts running groups of a
lower priority to make room. SRTF (thesis Alg. 2 + §4.5.3): FIFO waiting ->
staging queue (refilled in one batch only once empty) -> shortest-remaining-tokens
over running+staging.

When a running group cannot get blocks, the most recently arrived unscheduled
group is preempted as a whole, by recomputation (KV dropped, back to the front
of waiting) or by swapping to CPU (falling back to recompute when the CPU pool
cannot take it).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedjax.core.block_manager import AllocStatus, BlockManager
from pagedjax.core.sequence import (
    _FINISHED,
    _FIRST_FINISHED,
    _GO_ON,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedjax.core.steady_decode import DecodeCohort, SteadyRun

logger = logging.getLogger(__name__)

_PRIORITY = operator.attrgetter("priority")  # `Scheduler._priority`, as a C-level sort key

# The steady cohort's finished scan (`Scheduler.free_finished_seq_groups`): one `map` over its
# sequences' statuses, in C. (Only this pass gains from `map`: a pass reading several
# attributes per sequence is faster as one Python loop, CPython 3.12 specializing slot
# reads, than as a `map` per attribute: measured 2.3x slower for the steady pass.)
_STATUS = operator.attrgetter("status")
_RUNNING = SequenceStatus.RUNNING
# From this many running groups the `map` is the cheaper (20 vs 35 us at 256).
COLUMNS_MIN = 16

# A named tuple made from its fields' tuple in C, without the class's Python `__new__`.
new_tuple = tuple.__new__

# Token id of a scheduled token that a step still running on the device is sampling: the
# runner takes its id from that step's sampler output (async scheduling).
PENDING_TOKEN = -1


@dataclass(kw_only=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    policy: str = "fcfs"  # "fcfs" | "priority" | "srtf"
    staging_size: int = 8  # thesis §4.5.3: 8 balances SRTF quality vs overhead

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority", "srtf"):
            raise ValueError(f"unknown policy {self.policy!r}")
        if min(self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("limits must be positive")
        if self.staging_size < 1:
            raise ValueError("staging_size must be >= 1")


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step. A named tuple, which the decode fast path makes with
    ``tuple.__new__`` (`new_tuple`): one per sequence of every step, and a dataclass's
    ``__init__`` is a Python call."""

    seq_id: int
    request_id: str
    token_ids: list[int]  # the Δ tokens to compute this step
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    # Full physical block table after allocation for this step. From the scheduler it is the
    # KV manager's live list, not a copy: read it before the next `schedule()`. A hybrid
    # model's (`HybridBlockManager`): a tuple of one table per KV-cache group.
    block_table: list[int] | tuple[list[int], ...]
    needs_logits: bool  # all known tokens computed after this step -> sample
    # The table's version (`BlockManager.get_block_table_ref`): the same version as a table
    # seen before means only appends since. -1: unknown, the runner copies the whole table.
    # Hybrid: a tuple of one version per group.
    table_version: int | tuple[int, ...] = -1
    # Speculative decoding: the draft tokens at the end of `token_ids` (the step scores the
    # last known token and each draft: 1 + len(spec_token_ids) logits rows).
    spec_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    # `scheduled`: None while the step is a steady run only (`steady`), made on first use.
    _scheduled: list[ScheduledSeq] | None = field(default_factory=list)
    scheduled_groups: list[SequenceGroup] = field(default_factory=list)
    # The scheduler's own, for `update_after_step`: the general path's sequences and their
    # token counts, advanced once the step is launched; and the decode fast path's
    # (`Scheduler._decode_run`, advanced when scheduled, as vLLM V1's scheduler does) whose
    # computed length reached their `publish_at`, with the known length to publish.
    advance: list[tuple[Sequence, int]] = field(default_factory=list)
    publish: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Runner order before the step: swap out, then swap in, then copies.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list[SequenceGroup] = field(default_factory=list)
    # Groups whose scheduling raised (a bug or a failing KV manager): removed and freed, with
    # the error; the rest of the step goes on without them.
    failed: list[tuple[SequenceGroup, str]] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Entries the decode fast path made (`Scheduler._decode_run`): each one token, sampled,
    # no drafts. All of them when it equals ``len(scheduled)``.
    num_decode_run: int = 0
    # A steady decode step (`core.steady_decode`, `Scheduler._steady_step`): the whole step
    # is this run of the previous step's cohort, as columns; None once other groups are
    # scheduled with it (they take `scheduled`, which then lists the run's entries first).
    steady: SteadyRun | None = None
    _make_entries: Callable[[SteadyRun], list[ScheduledSeq]] | None = None

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Every scheduled sequence's entry, in step order."""
        if self._scheduled is None:
            self._scheduled = list(self.steady.entries(self._make_entries))
        return self._scheduled

    @scheduled.setter
    def scheduled(self, value: list[ScheduledSeq]) -> None:
        self._scheduled = value

    @property
    def is_empty(self) -> bool:
        if self.steady is not None:
            return False
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


class SampledToken(NamedTuple):
    """One sampled token for `Scheduler.update_from_output` to apply. A named tuple, which
    the engine's per-row loop makes with ``tuple.__new__`` (`new_tuple`): a few hundred are
    made every step, and a dataclass's ``__init__`` is a Python call."""

    request_id: str
    seq: Sequence  # the sequence whose logits row was sampled
    token_id: int
    logprob: float
    fork_index: int = 0  # > 0: sample j of a fresh n>1 prompt, which goes to a new child
    pending: bool = False  # counted in `seq.num_pending` when its step launched (async)
    # Speculative decoding, on a sequence's first token of the step: draft tokens the target
    # rejected, whose slots the step computed but whose KV is not the sequence's.
    rejected: int = 0


class AppliedToken(NamedTuple):
    """A token the scheduler appended: to which sequence, and whether it finished it (a named
    tuple, made per token with ``tuple.__new__``, as `SampledToken`)."""

    index: int  # position in the list given to `update_from_output`
    group: SequenceGroup
    seq: Sequence  # a new child for a fan-out sample
    forked: bool
    stop_reason: int | None  # the stop token id that finished it, if one did


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int  # waiting + staging
    num_swapped: int
    num_preemptions_total: int
    num_rejected_total: int
    kv_cache_usage: float
    num_free_gpu_blocks: int


class _Step:
    """Mutable per-call state of ``schedule``."""

    __slots__ = ("out", "budget", "num_seqs", "preempted")

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput()
        self.budget = budget
        self.num_seqs = 0
        self.preempted = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.staging: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions_total = 0
        self.num_rejected_total = 0
        self._groups: dict[str, SequenceGroup] = {}
        self._counter = itertools.count()
        self._finished_elsewhere: list[SequenceGroup] = []  # see `_free_finished_elsewhere`
        # Speculative decoding: drafts for decoding sequences (`pagedjax.spec`), or None.
        self.proposer = None
        self.num_guessed_drafts = 0  # proposals that followed a guessed pending token
        # The last step's running groups when all were lone decoding sequences: the next
        # step, if it is theirs again, takes `_steady_step` (`core.steady_decode`).
        self._cohort: DecodeCohort | None = None
        self.num_steady_steps = 0
        self.num_steady_cuts = 0  # cohorts cut down to the groups left (`without_gone`)
        self.num_steady_idle_cuts = 0  # ... or to those with a token to compute this step

    # -- request lifecycle ---------------------------------------------------
    @staticmethod
    def _priority(g: SequenceGroup) -> tuple:
        """Earlier arrival = higher priority (policy "priority": a lower request priority
        first, then earlier arrival); the largest key is preempted first."""
        return g.priority

    def _why_impossible(self, group: SequenceGroup) -> str | None:
        cfg = self.config
        seqs = group.get_unfinished_seqs()
        longest = max(s.num_total_tokens for s in seqs)
        if longest > cfg.max_model_len:
            return f"{longest} tokens exceed max_model_len={cfg.max_model_len}"
        if not cfg.enable_chunked_prefill and longest > cfg.max_num_batched_tokens:
            return (
                f"prompt of {longest} tokens exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} and chunked prefill is off"
            )
        if group.max_num_running_seqs() > cfg.max_num_seqs:
            return f"needs {group.max_num_running_seqs()} sequences > max_num_seqs"
        if self.bm.can_allocate(group) is AllocStatus.NEVER:
            return "needs more KV blocks than the whole cache"
        return None

    def add_seq_group(self, group: SequenceGroup) -> None:
        """Queue a request; raises ValueError for one that could never be scheduled."""
        if group.request_id in self._groups:
            raise ValueError(f"duplicate request id {group.request_id!r}")
        reason = self._why_impossible(group)
        if reason is not None:
            raise ValueError(f"request {group.request_id!r} rejected: {reason}")
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.WAITING
        group.output_limit = min(group.output_limit,
                                 self.config.max_model_len - len(group.seqs[0].prompt_token_ids))
        self._groups[group.request_id] = group
        if self.config.policy == "priority":
            group.priority = (group.request_priority, group.arrival_time, next(self._counter))
            bisect.insort(self.waiting, group, key=_PRIORITY)
        else:
            group.priority = (group.arrival_time, next(self._counter))
            self.waiting.append(group)

    def _requeue(self, g: SequenceGroup) -> None:
        """A group preempted by recomputation waits again: at the front (it arrived before
        anything waiting), or by its key under the priority policy, where a waiting group
        may outrank it."""
        if self.config.policy == "priority":
            bisect.insort(self.waiting, g, key=_PRIORITY)
        else:
            self.waiting.appendleft(g)

    def abort_seq_group(self, request_id: str) -> bool:
        """Abort and free a request wherever it is queued; safe between steps."""
        g = self._groups.pop(request_id, None)
        if g is None:
            return False
        for seq in g.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.bm.free(seq)
        for q in (self.running, self.staging, self.swapped, self.waiting):
            try:
                q.remove(g)
                break
            except ValueError:
                pass
        return True

    def recompute_all(self) -> list[str]:
        """Forget the KV of every in-flight request (the weights changed): running and swapped
        groups go back to the front of the waiting queue, in priority order, and are
        recomputed from their prompt and the tokens generated so far.

        A group with several live sequences (n > 1 after the fork, beams) shares blocks
        between them and cannot be recomputed one sequence at a time; if any is in flight
        this raises before changing anything."""
        groups = self.running + self.swapped
        multi = [g.request_id for g in groups if len(g.get_unfinished_seqs()) > 1]
        if multi:
            raise ValueError(f"params: cannot change weights while requests with several "
                             f"live sequences are in flight ({multi[:4]}); wait for them or "
                             f"abort them")
        for g in sorted(groups, key=self._priority, reverse=True):
            for seq in g.get_unfinished_seqs():
                self.bm.free(seq)
                seq.reset_for_recompute()
            self._requeue(g)
        self.running, self.swapped = [], []
        self.num_preemptions_total += len(groups)
        return [g.request_id for g in groups]

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.staging or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.staging) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's blocks with a child the engine adds to the same group."""
        self.bm.fork(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        self.bm.free(seq)

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        """Release blocks of finished sequences; returns the groups that completed."""
        done: list[SequenceGroup] = []
        keep: list[SequenceGroup] = []
        if self._finished_elsewhere:
            done += self._free_finished_elsewhere()
        c = self._cohort
        if (c is not None and len(self.running) >= COLUMNS_MIN and self.running == c.groups
                and SequenceGroup.seq_changes == c.layout
                and list(map(_STATUS, c.seqs)).count(_RUNNING) == len(c.seqs)):
            return done  # the steady cohort's lone sequences, all running: nothing to free
        for g in self.running:
            seqs = g.seqs
            if len(seqs) == 1 and seqs[0].status._value_ < _FIRST_FINISHED:
                keep.append(g)  # a lone running sequence: most groups of every step
                continue
            for seq in seqs:
                if seq.status.is_finished:
                    self.bm.free(seq)
            if g.is_finished():
                done.append(g)
                self._groups.pop(g.request_id, None)
            else:
                keep.append(g)
        self.running = keep
        return done

    # -- applying model outputs (the scheduler owns request state) ------------
    def update_from_output(self, tokens: list[SampledToken],
                           new_seq_id: Callable[[], int]) -> list[AppliedToken]:
        """Apply a step's sampled tokens (thesis §4.2; vLLM V1's `update_from_output`):
        fork the children of fan-out samples (sharing the prompt's blocks), append each
        token, and finish sequences by their token stops (EOS, stop ids), `max_tokens` or
        `max_model_len`. Tokens of requests that are gone (aborted, failed) or of sequences
        already finished (a stop found one step late under async scheduling) are dropped.
        Blocks are freed by `free_finished_seq_groups`, after the output processor had its
        chance to stop more sequences (stop strings, `stop_seq`)."""
        applied: list[AppliedToken] = []
        add = applied.append
        groups = self._groups
        children: dict[int, Sequence] = {}
        special = [i for i, t in enumerate(tokens) if t.fork_index > 0 or t.rejected]
        for i in special:  # fork first: children copy the parent's pre-step state
            t = tokens[i]
            if t.fork_index > 0 and (g := groups.get(t.request_id)) is not None:
                child = t.seq.fork(new_seq_id())
                self.bm.fork(t.seq, child)
                g.add(child)
                children[i] = child
        for i in special:  # speculative steps: forget the rejected drafts' slots first
            t = tokens[i]
            if t.rejected and groups.get(t.request_id) is not None \
                    and t.seq.status not in _FINISHED:
                t.seq.num_computed_tokens -= t.rejected
                self.bm.trim(t.seq, t.seq.num_computed_tokens + 1)
        forked = bool(children)
        # Unpacked in C: the loop runs for every token of every step.
        for i, (rid, seq, tok, lp, _, pending, _) in enumerate(tokens):
            g = groups.get(rid)
            if g is None:
                continue
            if forked:
                seq = children.get(i, seq)
            if seq.status in _FINISHED:
                continue
            if pending:
                seq.num_pending -= 1
            out = seq.output_token_ids
            out.append(tok)  # `Sequence.append_token`, inlined: once per token of every step
            seq.cumulative_logprob += lp
            n_out = len(out)
            stops = g.stops
            # `TokenStops.check` only for a token that may stop it (most tokens cannot).
            stopped, reason = stops.check(tok, n_out) if tok in stops.any_ids else _GO_ON
            if stopped:
                self._finish_seq(g, seq, SequenceStatus.FINISHED_STOPPED)
            elif n_out >= g.output_limit:  # max_tokens, or max_model_len
                self._finish_seq(g, seq, SequenceStatus.FINISHED_LENGTH)
            add(new_tuple(AppliedToken, (i, g, seq, forked and i in children, reason)))
        return applied

    def update_from_rows(self, rows: list[tuple], token_ids: list[int], logprobs: list[float],
                         pending: dict[int, int], ended_only: bool = False
                         ) -> tuple[list[AppliedToken], int]:
        """`update_from_output` for a step whose row i is the one token of ``rows[i]``: the
        row's owner (any object with a ``group``), its group's lone sequence, and two fields
        this ignores (the engine's row info). No fork, no draft: each token appends to its
        sequence, checked as there. ``pending``: sequence id -> row, for rows whose token
        the sequence holds as pending (async scheduling; the step's own: it names only
        sequences of ``rows``, one row each). A sequence that finished or was
        aborted meanwhile drops its token: its group may be gone, or its id reused.
        Returns the applied tokens and their count; ``ended_only``: only those that finished
        their sequence are listed (the caller has nothing to do for the others)."""
        applied: list[AppliedToken] = []
        add = applied.append
        i = -1
        dropped = 0
        # Every row pending (a steady async step): rows are distinct sequences, so as many
        # entries as rows means each row's own (no lookup per row).
        every = len(pending) == len(rows)
        for (owner, seq, _, _), tok, lp in zip(rows, token_ids, logprobs):
            i += 1
            if seq.status._value_ >= _FIRST_FINISHED:
                dropped += 1
                continue
            if every or pending and pending.get(seq.seq_id) == i:
                seq.num_pending -= 1
            out = seq.output_token_ids
            out.append(tok)
            seq.cumulative_logprob += lp
            g = owner.group
            if tok in g.stops.any_ids:  # `TokenStops.check` only for a token that may stop it
                stopped, reason = g.stops.check(tok, len(out))
                if stopped:
                    self._finish_seq(g, seq, SequenceStatus.FINISHED_STOPPED)
                    add(new_tuple(AppliedToken, (i, g, seq, False, reason)))
                    continue
            if len(out) >= g.output_limit:
                self._finish_seq(g, seq, SequenceStatus.FINISHED_LENGTH)
            elif ended_only:
                continue
            add(new_tuple(AppliedToken, (i, g, seq, False, None)))
        return applied, i + 1 - dropped

    def update_steady(self, run: SteadyRun, token_ids: list[int], pending: dict[int, int],
                      listed: list[int] | None = None, logprobs: list[float] | None = None
                      ) -> tuple[list[AppliedToken], int]:
        """`update_from_rows(..., ended_only=True)` for a steady step (``run``) whose rows are
        its cohort's sequences, in order, and whose requests read no logprob (`quiet` rows:
        nothing reports their logprobs or cumulative logprob, so neither is kept). Each row
        is an append and a length test in one loop over the cohort's columns
        (`DecodeCohort.columns`); stop ids are looked for over the step's tokens at once (a
        set's `isdisjoint`, in C), and only rows holding one are checked as there. Same
        tokens, finishes, reasons and order as `update_from_rows`. ``listed`` (row indices,
        ascending): rows whose requests read logprobs, their cumulative logprob advanced by
        ``logprobs``; entered, as the others, when they ended (the engine's output processor
        takes the running ones from the cohort's columns, `OutputProcessor.listed_rows`)."""
        c = run.cohort
        seqs, groups = c.seqs, c.groups
        outs, limits, stop_any = c.columns()
        first_finished = _FIRST_FINISHED
        long: list[int] = []  # rows at their output limit
        dropped: list[int] | None = None  # rows of sequences finished (or aborted) meanwhile
        every = len(pending) == len(seqs)  # rows are distinct sequences: each row's own
        i = -1
        for seq, out, tok, limit in zip(seqs, outs, token_ids, limits):
            i += 1
            if seq.status._value_ >= first_finished:
                if dropped is None:
                    dropped = []
                dropped.append(i)
                continue
            if every:
                seq.num_pending -= 1
            out.append(tok)
            if len(out) >= limit:
                long.append(i)
        gone = set(dropped) if dropped else ()
        if pending and not every:
            for r in pending.values():
                if r not in gone:
                    seqs[r].num_pending -= 1
        if listed:
            for r in listed:
                if r not in gone:
                    seqs[r].cumulative_logprob += logprobs[r]
        if stop_any.isdisjoint(token_ids):
            hits: list[int] = []
        else:
            hits = [r for r, t in zip(range(len(seqs)), token_ids) if t in stop_any]
        if not (long or hits):
            return [], i + 1 - len(gone)
        stops = set(hits)
        applied: list[AppliedToken] = []
        for r in sorted(stops.union(long)):  # in row order, as `update_from_rows`
            if r in gone:
                continue
            g, seq = groups[r], seqs[r]
            if r in stops and token_ids[r] in g.stops.any_ids:
                stopped, reason = g.stops.check(token_ids[r], len(outs[r]))
                if stopped:
                    self._finish_seq(g, seq, SequenceStatus.FINISHED_STOPPED)
                    applied.append(new_tuple(AppliedToken, (r, g, seq, False, reason)))
                    continue
            if len(outs[r]) >= limits[r]:
                self._finish_seq(g, seq, SequenceStatus.FINISHED_LENGTH)
                applied.append(new_tuple(AppliedToken, (r, g, seq, False, None)))
        return applied, i + 1 - len(gone)

    def stop_seq(self, seq: Sequence, status: SequenceStatus, request_id: str) -> None:
        """Finish a sequence for a reason the scheduler cannot see (a stop string in its
        text); its blocks are freed by the next `free_finished_seq_groups`."""
        g = self._groups.get(request_id)
        if g is not None:
            self._finish_seq(g, seq, status)

    def _finish_seq(self, g: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        seq.num_pending = 0  # a token a launched step samples for it is dropped
        if g not in self.running:
            # Preempted while its last token was on the device (async scheduling): freed
            # where it waits, by `free_finished_seq_groups`.
            self._finished_elsewhere.append(g)

    def _free_finished_elsewhere(self) -> list[SequenceGroup]:
        """Finished sequences of groups that are not running: a sequence preempted (swapped
        out, or sent back to waiting) while its last token was on the device can finish when
        that token is applied; without this its group would sit in a queue forever."""
        done = []
        running = {id(g) for g in self.running}
        for g in dict.fromkeys(self._finished_elsewhere):
            if id(g) in running:
                continue
            for seq in g.seqs:
                if seq.status.is_finished:
                    self.bm.free(seq)
            # By identity: an aborted group's id may already name a new request.
            if g.is_finished() and self._groups.get(g.request_id) is g:
                del self._groups[g.request_id]
                done.append(g)
                for q in (self.staging, self.swapped, self.waiting):
                    try:
                        q.remove(g)
                        break
                    except ValueError:
                        pass
        self._finished_elsewhere = []
        return done

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.staging),
            num_swapped=len(self.swapped),
            num_preemptions_total=self.num_preemptions_total,
            num_rejected_total=self.num_rejected_total,
            kv_cache_usage=self.bm.usage(),
            num_free_gpu_blocks=self.bm.get_num_free_gpu_blocks(),
        )

    # -- step ----------------------------------------------------------------
    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step was launched: advance num_computed_tokens (of the general path's
        sequences: the decode fast path advanced its own when it scheduled them) and publish
        newly full blocks."""
        mark = self.bm.mark_blocks_computed
        publish = getattr(self.bm, "publish_computed", None)
        if publish is not None and len(output.publish) > 1:  # one call for the step's blocks
            publish([(seq, m) for seq, m in output.publish
                     if seq.status._value_ < _FIRST_FINISHED])  # else e.g. aborted meanwhile
        else:
            for seq, m in output.publish:
                if seq.status._value_ < _FIRST_FINISHED:
                    mark(seq, m)
        for seq, d in output.advance:
            if seq.status._value_ >= _FIRST_FINISHED:
                continue
            n = seq.num_computed_tokens = seq.num_computed_tokens + d
            # Only known tokens are hashed: a block completed by a pending token is
            # published by a later step, once its id is known.
            m = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            if n < m:
                m = n
            if m >= seq.publish_at:  # else no block filled since the last call: nothing to do
                mark(seq, m)

    def schedule(self) -> SchedulerOutput:
        st = _Step(self.config.max_num_batched_tokens)
        policy = self.config.policy
        if policy == "fcfs":
            if not self._steady_step(st):
                self._schedule_running(st, sorted(self.running, key=_PRIORITY), [])
            self._schedule_swapped(st)
            if not self.swapped and not st.preempted:
                self._schedule_waiting_fcfs(st)
        elif policy == "priority":
            if self.running and (self.waiting or self.swapped):
                self._make_room(st)
                st.preempted = False  # preempted to admit: admissions go on this step
                self._schedule_running(st, sorted(self.running, key=_PRIORITY), [])
            elif not self._steady_step(st):
                self._schedule_running(st, sorted(self.running, key=_PRIORITY), [])
            if not st.preempted:  # short of blocks for the running groups: admit nothing
                self._schedule_queued_by_priority(st)
        else:
            self._cohort = None
            self._schedule_srtf(st)
        out = st.out
        if out.steady is not None and out._scheduled is not None:
            out.steady = None  # other groups joined the run: the step takes the entries
        return out

    def _steady_step(self, st: _Step) -> bool:
        """Schedule the last step's cohort again (`core.steady_decode`) if the running groups
        are still its groups, in order (less any that ended since), each still a lone running
        sequence one token from its known tokens (pending ones included, as many as then),
        and each next slot in place: a slot inside a block was checked (exclusive, in place)
        when the block opened, and only a fork or a swap, which change the group or the
        running list, can share or move it; a slot that opens a block takes `decode_slot`,
        as in `_decode_run`. Else nothing is changed (sequences advanced so far are set
        back, blocks opened for them stay theirs) and False: the general path schedules the
        step, and makes a new cohort if it can."""
        c = orig = self._cohort
        if c is None:
            return False
        if SequenceGroup.seq_changes != c.layout:
            self._cohort = None
            return False
        if self.running != c.groups:  # some gone since (finished, aborted)? else not steady
            c = self._cohort = c.without_gone(self.running)
            if c is None:
                return False
            self.num_steady_cuts += 1
        n = len(c.seqs)
        if st.budget < n or self.config.max_num_seqs - st.num_seqs < c.room:
            self._cohort = None
            return False
        running = SequenceStatus.RUNNING
        decode_slot = self.bm.decode_slot
        bs = self.bm.block_size
        p = c.pending
        starts: list[int] = []
        publish: list[tuple[Sequence, int]] = []
        slotted: list[tuple[int, list[int], int]] = []
        add_start, add_publish = starts.append, publish.append
        token_ids: list[int] | None = None if p else []
        add_token = None if p else token_ids.append
        i = done = 0  # entries made; cohort sequences seen
        idle: list[int] | None = None
        try:
            for seq in c.seqs:
                start = seq.num_computed_tokens
                known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
                if seq.status is not running:
                    break
                if seq.num_pending != p or known + p - start != 1:
                    if seq.num_pending or known != start:
                        break
                    # Nothing to compute: with async scheduling, a sequence whose certain
                    # last token (its length) is on the device was not given it as pending.
                    # The general path leaves it out of the step; so does this, by cutting
                    # the cohort (it ends when that token is applied).
                    if idle is None:
                        idle = []
                    idle.append(done)
                    done += 1
                    continue
                if not start % bs:  # the slot opens a block (or one opened before is there)
                    ref = decode_slot(seq)
                    if ref is None:
                        break
                    slotted.append((i, ref[0], ref[1]))
                seq.num_computed_tokens = start + 1  # advanced when scheduled, as `_decode_run`
                add_start(start)
                if add_token is not None:  # the last known token (none pending)
                    out = seq.output_token_ids
                    add_token(out[-1] if out else seq.prompt_token_ids[-1])
                if known >= seq.publish_at:  # `_decode_run`'s m: the known length here
                    add_publish((seq, known))
                i += 1
                done += 1
        except Exception:  # (`decode_slot`) the general path meets it again and fails that group
            pass
        if done < n or not i:
            skip = set(idle or ())
            for k, seq in enumerate(c.seqs[:done]):
                if k not in skip:
                    seq.num_computed_tokens -= 1
            self._cohort = None
            return False
        if idle is not None:
            skip = set(idle)
            kept = [k for k in range(n) if k not in skip]
            mid, c = c, c.cut(kept)
            if mid is not orig:  # cut twice this step: indices into the cohort before (the
                first = mid.parent[1]  # one whose caches are kept, not the one between)
                c.parent = (orig.key, [first[k] for k in kept])
            self._cohort = c
            self.num_steady_cuts += 1
            self.num_steady_idle_cuts += 1
            n = i
        out = st.out
        out._scheduled = None
        out.steady = SteadyRun(c, starts, token_ids, slotted)
        out._make_entries = self._steady_entries
        out.scheduled_groups = list(c.groups)
        out.publish = publish
        out.num_batched_tokens += n
        out.num_decode_run += n
        st.budget -= n
        st.num_seqs += c.room
        self.num_steady_steps += 1
        return True

    def _steady_entries(self, run: SteadyRun) -> list[ScheduledSeq]:
        """A steady run's `ScheduledSeq` entries, as `_decode_run` makes them."""
        version = self.bm.table_version
        token_ids, c = run.token_ids, run.cohort
        return [new_tuple(ScheduledSeq, (seq.seq_id, g.request_id,
                                         [PENDING_TOKEN if token_ids is None else token_ids[i]],
                                         run.starts[i], c.tables[i], True, version(seq), ()))
                for i, (g, seq) in enumerate(zip(c.groups, c.seqs, strict=True))]

    def _make_cohort(self, st: _Step) -> None:
        """After the running groups' part of a general step: remember the groups it
        scheduled as a cohort (`_steady_step`) if the decode run scheduled every one of them.
        Running groups it left out (with nothing to compute: a last token still on the
        device) are not in it; the next step is steady only if they are gone by then."""
        self._cohort = None
        out = st.out
        n = len(out.scheduled)
        if (not n or st.preempted or out.num_decode_run != n or len(out.scheduled_groups) != n
                or self.proposer is not None or getattr(self.bm, "decode_slot", None) is None):
            return
        # The decode run's entries, one per group, in its order.
        groups = list(out.scheduled_groups)
        seqs = [g.seqs[0] for g in groups]
        pending = seqs[0].num_pending
        if pending > 1 or any(s.num_pending != pending for s in seqs):
            return
        self._cohort = DecodeCohort(groups, seqs, [s.block_table for s in out.scheduled],
                                    sum(g.n for g in groups), pending)

    # -- pieces ----------------------------------------------------------------
    def _plan(self, g: SequenceGroup, budget: int, allow_chunk: bool) -> list[tuple[Sequence, int]] | None:
        """Per-sequence Δ within the budget; None if it must run whole and does not fit."""
        seqs = g.seqs
        spec = self.proposer is not None
        if len(seqs) == 1:  # fast path: single sequence
            seq = seqs[0]
            if seq.status in _FINISHED:
                return []
            d = seq.num_uncomputed_tokens
            if d <= 0:
                return []
            if d > budget:
                if not allow_chunk:
                    return None
                d = budget
            if spec:
                d += self._propose(g, seq, budget - 1) if d == 1 else self._no_drafts(seq)
            return [(seq, d)] if d > 0 else []
        plan: list[tuple[Sequence, int]] = []
        for seq in seqs:
            if seq.status in _FINISHED:
                continue
            d = seq.num_uncomputed_tokens
            if d <= 0:
                continue
            if d > budget:
                if not allow_chunk:
                    return None
                d = budget
            if d == 0:
                break
            if spec:
                d += self._propose(g, seq, budget - 1) if d == 1 else self._no_drafts(seq)
            plan.append((seq, d))
            budget -= d
        return plan

    @staticmethod
    def _no_drafts(seq: Sequence) -> int:
        seq.spec_token_ids = []  # drafts of a plan that was never emitted are stale
        return 0

    def _propose(self, g: SequenceGroup, seq: Sequence, room: int) -> int:
        """Draft tokens for a decoding sequence (speculative decoding), kept in
        ``seq.spec_token_ids`` for `_emit`: at most ``room`` (the step's budget) and the
        proposer's ``k``, never past ``max_tokens`` or ``max_model_len`` (a step emits up to
        drafts + 1 tokens), and none when the drafts' blocks are not free now (speculation
        never preempts).

        Under async scheduling the sequence's last token may still be on the device (one
        pending token). The drafts then follow a guess of it: the proposal for the known
        tokens is asked for one token more and its first token stands for the pending one.
        Verification is unchanged and exact either way (the step feeds the real pending token
        and each draft is checked against the row before it); a wrong guess only costs the
        drafts. Without this a sequence that once decoded asynchronously would never draft
        again, since every step it is scheduled in leaves it a pending token."""
        seq.spec_token_ids = []
        p = seq.num_pending
        if p > 1 or not (seq.output_token_ids or p):
            return 0  # prompt steps and fan-outs sample one row
        k = min(room, self.proposer.k, self.config.max_model_len - seq.num_total_tokens - p - 1)
        if g.max_tokens is not None:
            k = min(k, g.max_tokens - seq.num_output_tokens - p - 1)
        if k <= 0:
            return 0
        if p:
            drafts = self.proposer.propose_for(seq, k + 1)[1:]
            self.num_guessed_drafts += bool(drafts)
        else:
            drafts = self.proposer.propose_for(seq, k)
        if drafts and self.bm.blocks_needed(seq, 1 + len(drafts)) > \
                self.bm.get_num_free_gpu_blocks():
            drafts = []
        seq.spec_token_ids = drafts
        return len(drafts)

    def _emit(self, st: _Step, g: SequenceGroup, plan: list[tuple[Sequence, int]]) -> None:
        out = st.out
        bm = self.bm
        for seq, d in plan:
            copies = bm.append_slots(seq, d)
            if copies:
                out.blocks_to_copy.extend(copies)
            start = seq.num_computed_tokens
            end = start + d
            known = seq.num_total_tokens
            spec = seq.spec_token_ids
            if spec:  # the last known (or pending) token, then the drafts
                ids = seq.get_token_slice(start, known) + [PENDING_TOKEN] * seq.num_pending + spec
                seq.spec_token_ids = []
            else:
                ids = seq.get_token_slice(start, end)
                if end > known:  # tokens still on the device (async scheduling): placeholders
                    ids = ids + [PENDING_TOKEN] * (end - max(start, known))
            table, version = bm.get_block_table_ref(seq)
            out.scheduled.append(ScheduledSeq(seq.seq_id, g.request_id, ids, start, table,
                                              bool(spec) or end == known + seq.num_pending,
                                              version, tuple(spec)))
            out.advance.append((seq, d))
            st.budget -= d
            out.num_batched_tokens += d
        # A lone prompt of an n>1 request fans out into n sampled rows when its prefill ends:
        # reserve its n slots every step, so no step ever samples more than max_num_seqs rows.
        st.num_seqs += max(len(plan), g.max_num_running_seqs())
        out.scheduled_groups.append(g)

    def _fits_blocks(self, g: SequenceGroup, plan: list[tuple[Sequence, int]]) -> bool:
        needed = self.bm.blocks_needed
        need = 0
        for seq, d in plan:
            need += needed(seq, d)
        return need <= self.bm.get_num_free_gpu_blocks()

    def _decode_fast(self, st: _Step, g: SequenceGroup) -> bool:
        """`_decode_run` for one group: True if it took the fast path."""
        queue = deque((g,))
        self._decode_run(st, queue, [])
        return not queue

    def _decode_run(self, st: _Step, queue: deque[SequenceGroup], keep: list[SequenceGroup]
                    ) -> None:
        """Schedule the lone decoding sequences at the head of ``queue`` whose next slot is in
        place or takes one free block (`BlockManager.decode_slot`): what `_plan`,
        `_fits_blocks` and `_emit` would do for each, without their general work (the host's
        per-step cost at hundreds of sequences), in one loop, the step's counters kept in
        locals. Each is popped and added to ``keep``; the run stops, having changed nothing
        for it, at the first group that needs more (left at the head) or when the budget is
        spent. An exception leaves the group that raised at the head, for the caller to fail."""
        decode_slot = getattr(self.bm, "decode_slot", None)  # the hybrid manager has none
        if decode_slot is None or self.proposer is not None:
            return
        out = st.out
        add_sched, add_publish = out.scheduled.append, out.publish.append
        ran: list[SequenceGroup] = []  # the run's groups, added to `keep` and the step's at once
        take, add_group = queue.popleft, ran.append
        running = SequenceStatus.RUNNING
        room = room0 = self.config.max_num_seqs - st.num_seqs  # sequence slots left
        budget = st.budget
        try:
            while queue and budget > 0:
                g = queue[0]
                try:
                    seq, = g.seqs
                except ValueError:  # not a lone sequence
                    break
                if seq.status is not running:
                    break
                start = seq.num_computed_tokens
                prompt, output = seq.prompt_token_ids, seq.output_token_ids
                p = len(prompt)
                known = p + len(output)
                if known + seq.num_pending - start != 1 or g.n > room:
                    break
                ref = decode_slot(seq)
                if ref is None:
                    break
                take()
                # The token at `start` (`get_token_slice`, inlined), or a pending one.
                if start < known:
                    ids = [output[start - p] if start >= p else prompt[start]]
                    m = start + 1  # known tokens computed after the step
                else:
                    ids = [PENDING_TOKEN]
                    m = known
                add_sched(new_tuple(ScheduledSeq, (seq.seq_id, g.request_id, ids, start, ref[0],
                                                   True, ref[1], ())))
                # Advanced now (`update_after_step` only publishes): nothing reads it
                # before the step is launched, and a step that fails aborts its groups.
                seq.num_computed_tokens = start + 1
                if m >= seq.publish_at:  # a block filled: published once the step is launched
                    add_publish((seq, m))
                add_group(g)
                budget -= 1
                room -= g.n
        finally:
            keep += ran
            out.scheduled_groups += ran
            out.num_batched_tokens += st.budget - budget  # one token each
            out.num_decode_run += st.budget - budget
            st.budget = budget
            st.num_seqs += room0 - room

    def _schedule_one_running(
        self, st: _Step, g: SequenceGroup, victims: deque[SequenceGroup] | _VictimPool
    ) -> bool | None:
        """Schedule a running group, preempting from ``victims`` (tail = lowest priority).

        Returns True if scheduled, False if left unscheduled this step, None if
        the group itself was preempted.
        """
        if st.budget <= 0:
            return False
        if len(g.seqs) == 1 and self.proposer is None and self._decode_fast(st, g):
            return True
        plan = self._plan(g, st.budget, allow_chunk=True)
        if not plan or st.num_seqs + max(len(plan), g.max_num_running_seqs()) > self.config.max_num_seqs:
            return False
        while not self._fits_blocks(g, plan):
            if victims:
                victim = victims.pop()
                try:
                    self._preempt(st, victim)
                except Exception as exc:  # the victim fails (its blocks freed), g goes on
                    self._fail_group(st, victim, exc)
            else:
                self._preempt(st, g)
                return None
        self._emit(st, g, plan)
        return True

    def _schedule_running(self, st: _Step, ordered: list[SequenceGroup], keep: list[SequenceGroup]) -> None:
        """FCFS over running groups in priority order; the tail serves as the victim pool."""
        queue = deque(ordered)  # popping from the right takes the latest unscheduled arrival
        decode_run = self._decode_run
        while queue:
            try:
                # Lone decoding sequences (most of a step) straight to the fast path.
                decode_run(st, queue, keep)
            except Exception as exc:  # the group that raised is at the head
                self._fail_group(st, queue.popleft(), exc)
                continue
            if not queue:
                break
            g = queue.popleft()
            try:
                res = self._schedule_one_running(st, g, queue)
            except Exception as exc:
                self._fail_group(st, g, exc)
                continue
            if res is not None:
                keep.append(g)
        self.running = keep
        self._make_cohort(st)

    def _preempt(self, st: _Step, g: SequenceGroup) -> None:
        seqs = g.get_unfinished_seqs()
        mode = self.config.preemption_mode
        if len(seqs) > 1:
            # Sequences of one group share blocks; recomputing them separately
            # would duplicate the shared prefix, so prefer swapping.
            mode = "swap"
        if mode == "swap" and self.bm.can_swap_out(g):
            st.out.blocks_to_swap_out.extend(self.bm.swap_out(g))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(g)
        else:
            for seq in seqs:
                self.bm.free(seq)
                seq.reset_for_recompute()
            self._requeue(g)
        st.preempted = True
        st.out.preempted.append(g.request_id)
        self.num_preemptions_total += 1

    def _schedule_swapped(self, st: _Step) -> None:
        if not self.swapped or st.preempted:
            return
        self.swapped.sort(key=self._priority)
        while self.swapped and self._swap_in_head(st):
            pass

    def _swap_in_head(self, st: _Step) -> bool:
        """Swap in the first swapped group (sorted) if it fits; False when it must wait."""
        g = self.swapped[0]
        plan_n = g.num_unfinished
        if st.num_seqs + plan_n > self.config.max_num_seqs or st.budget < plan_n:
            return False
        status = self.bm.swap_in_status(g)
        if status is AllocStatus.NEVER:  # outgrew the whole cache while running
            self.swapped.pop(0)
            for seq in g.seqs:
                self.bm.free(seq)
            self._reject(st, g)
            return True
        if status is AllocStatus.LATER:
            return False
        self.swapped.pop(0)
        try:
            st.out.blocks_to_swap_in.extend(self.bm.swap_in(g))
            for seq in g.get_unfinished_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(g)
            plan = self._plan(g, st.budget, allow_chunk=True)
            if plan:
                self._emit(st, g, plan)
        except Exception as exc:
            self._fail_group(st, g, exc)
        return True

    def _schedule_queued_by_priority(self, st: _Step) -> None:
        """Swapped and waiting groups in one key order, up to the first that must wait: a
        group never overtakes one of higher priority (nor, at equal priority, an earlier
        arrival), whichever queue each is in."""
        self.swapped.sort(key=_PRIORITY)
        while self.swapped or self.waiting:
            if self.swapped and (not self.waiting
                                 or self.swapped[0].priority < self.waiting[0].priority):
                if not self._swap_in_head(st):
                    return
                continue
            g = self.waiting[0]
            res = self._guarded_admit(st, g)
            if res == "reject":
                self.waiting.popleft()
                self._reject(st, g)
            elif res == "ok":
                self.waiting.popleft()
                self.running.append(g)
            elif res != "failed":
                return

    def _make_room(self, st: _Step) -> None:
        """Priority policy: queued groups (waiting or swapped), best first, that cannot be
        placed now for want of sequence slots or KV blocks preempt running groups of lower
        priority, the lowest first, until they can be; never one of equal or higher
        priority. Stops at the first queued group that still cannot be placed, as admission
        does; the groups preempted for it wait behind it (strict priority: they could not be
        admitted before it anyway). Blocks the running groups and the groups placed before
        take this step are not reserved: if that leaves a group short, it preempts again at
        the next step."""
        # Only a lower request priority is displaced, never a later arrival of the same one:
        # arrival stamps come from the front ends' threads and may be out of order by a hair.
        ordered = sorted(self.running, key=_PRIORITY)
        swapped = sorted(self.swapped, key=_PRIORITY)
        lowest = ordered[-1].request_priority
        best = min(self.waiting[0].request_priority if self.waiting else lowest,
                   swapped[0].request_priority if swapped else lowest)
        if lowest <= best:
            return  # nothing running has a lower priority than a queued group: the usual case
        cfg = self.config
        was_swapped = {id(g) for g in swapped}
        used = sum(g.max_num_running_seqs() for g in ordered)
        # Snapshots: preempting a victim queues it (and it ranks below every group left).
        for head in heapq.merge(list(self.waiting), swapped, key=_PRIORITY):
            if not ordered or ordered[-1].request_priority <= head.request_priority:
                break
            if id(head) in was_swapped:
                need, fits = head.num_unfinished, self.bm.swap_in_status
            else:
                need, fits = head.max_num_running_seqs(), self.bm.can_allocate
                if any(s.num_total_tokens > cfg.max_model_len
                       for s in head.get_unfinished_seqs()):
                    break  # admission rejects it
            if fits(head) is AllocStatus.NEVER:
                break
            while ordered and ordered[-1].request_priority > head.request_priority and (
                    used + need > cfg.max_num_seqs or fits(head) is not AllocStatus.OK):
                victim = ordered.pop()
                used -= victim.max_num_running_seqs()
                try:
                    self._preempt(st, victim)
                except Exception as exc:
                    self._fail_group(st, victim, exc)
            if used + need > cfg.max_num_seqs or fits(head) is not AllocStatus.OK:
                break
            used += need  # placed by `_schedule_queued_by_priority` later in this step
        self.running = ordered

    def _reject(self, st: _Step, g: SequenceGroup) -> None:
        for seq in g.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_IGNORED
        self._groups.pop(g.request_id, None)
        st.out.rejected.append(g)
        self.num_rejected_total += 1

    def _try_admit(self, st: _Step, g: SequenceGroup) -> str:
        """Admit one waiting/staged group. Returns "ok", "reject", "later" or "skip"."""
        cfg = self.config
        if st.num_seqs + g.max_num_running_seqs() > cfg.max_num_seqs:
            return "skip"
        status = self.bm.can_allocate(g)
        if status is AllocStatus.NEVER or any(
            s.num_total_tokens > cfg.max_model_len for s in g.get_unfinished_seqs()
        ):
            return "reject"
        if status is AllocStatus.LATER:
            return "later"
        if st.budget <= 0:
            return "skip"
        seqs = g.get_unfinished_seqs()
        delta = sum(s.num_total_tokens - self._cached_tokens(g, s) for s in seqs)
        # Without chunked prefill a prompt runs whole; a recompute longer than
        # the whole budget (prompt + outputs) is the one exception, chunked so
        # it cannot block forever.
        allow_chunk = cfg.enable_chunked_prefill or delta > cfg.max_num_batched_tokens
        if not allow_chunk and delta > st.budget:
            return "skip"
        self.bm.allocate(g)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        plan = self._plan(g, st.budget, allow_chunk=True)
        if plan:
            self._emit(st, g, plan)
        return "ok"

    def _cached_tokens(self, g: SequenceGroup, seq: Sequence) -> int:
        """Tokens an allocation for ``seq`` now would take from the prefix cache."""
        if not g.read_prefix_cache:
            return 0
        return self.bm.get_num_cached_tokens(seq, g.extra_hash_keys)

    def _guarded_admit(self, st: _Step, g: SequenceGroup) -> str:
        """`_try_admit`, or "failed" (the group removed and freed) if it raised."""
        try:
            return self._try_admit(st, g)
        except Exception as exc:
            self._fail_group(st, g, exc)
            return "failed"

    def _fail_group(self, st: _Step, g: SequenceGroup, exc: Exception) -> None:
        """Contain an exception raised while scheduling ``g``: drop what was emitted for it
        this step, free its blocks, remove it everywhere and report it in ``failed``; the
        other groups of the step are unaffected."""
        logger.exception("scheduling request %s failed", g.request_id)
        out = st.out
        out.scheduled = [s for s in out.scheduled if s.request_id != g.request_id]
        mine = {id(seq) for seq in g.seqs}
        out.advance = [x for x in out.advance if id(x[0]) not in mine]
        out.publish = [x for x in out.publish if id(x[0]) not in mine]
        out.scheduled_groups = [x for x in out.scheduled_groups if x is not g]
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.scheduled)
        # Not known any more (a run's entry may have gone): negative whatever later runs
        # add, so readers check the entries.
        out.num_decode_run = -(1 << 40)
        st.budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        for seq in g.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            try:
                self.bm.free(seq)
            except Exception:  # nothing more can be done for this group's blocks
                logger.exception("freeing the blocks of request %s failed", g.request_id)
        self._groups.pop(g.request_id, None)
        for q in (self.running, self.staging, self.swapped, self.waiting):
            while g in q:
                q.remove(g)
        out.failed.append((g, f"{type(exc).__name__}: {exc}"))

    def _schedule_waiting_fcfs(self, st: _Step) -> None:
        while self.waiting:
            g = self.waiting[0]
            res = self._guarded_admit(st, g)
            if res == "failed":
                continue
            if res == "reject":
                self.waiting.popleft()
                self._reject(st, g)
            elif res == "ok":
                self.waiting.popleft()
                self.running.append(g)
            else:
                break

    def _schedule_srtf(self, st: _Step) -> None:
        """Two-level scheduling (thesis Alg. 2 + §4.5.3).

        Starvation-free: staging refills only once every staged request was
        admitted, so later arrivals cannot overtake a staged request forever.
        Prefix-cache hits of staged requests are refreshed once per step (not
        after every pick as in Alg. 2): blocks become hittable only after the
        step that computes them, so an in-step refresh could find nothing new.
        """
        if not self.staging:
            while self.waiting and len(self.staging) < self.config.staging_size:
                self.staging.append(self.waiting.popleft())
        cands: list[tuple[tuple, int, SequenceGroup]] = []
        for g in self.running:
            key = (g.num_uncomputed_tokens(), g.remaining_output_estimate(), *self._priority(g))
            cands.append((key, 0, g))
        if not self.swapped:
            for g in self.staging:
                delta = sum(s.num_total_tokens - self._cached_tokens(g, s)
                            for s in g.get_unfinished_seqs())
                key = (delta, g.remaining_output_estimate(), *self._priority(g))
                cands.append((key, 1, g))
        cands.sort(key=lambda c: c[0])

        pool = _VictimPool(sorted(self.running, key=self._priority))
        keep: list[SequenceGroup] = []
        for _, kind, g in cands:
            if kind == 0:
                if pool.taken(g):  # preempted earlier in this step
                    continue
                pool.take(g)
                try:
                    if self._schedule_one_running(st, g, pool) is not None:
                        keep.append(g)
                except Exception as exc:
                    self._fail_group(st, g, exc)
            elif not st.preempted and not self.swapped:
                res = self._guarded_admit(st, g)
                if res == "ok":
                    self.staging.remove(g)
                    keep.append(g)
                elif res == "reject":
                    self.staging.remove(g)
                    self._reject(st, g)
        self.running = keep
        self._schedule_swapped(st)


class _VictimPool:
    """Running groups by priority; ``pop`` yields the latest arrival not yet taken."""

    def __init__(self, ordered: list[SequenceGroup]) -> None:
        self._q = list(ordered)
        self._taken: set[int] = set()

    def take(self, g: SequenceGroup) -> None:
        self._taken.add(id(g))

    def taken(self, g: SequenceGroup) -> bool:
        return id(g) in self._taken

    def _trim(self) -> None:
        while self._q and id(self._q[-1]) in self._taken:
            self._q.pop()

    def __bool__(self) -> bool:
        self._trim()
        return bool(self._q)

    def pop(self) -> SequenceGroup:
        self._trim()
        g = self._q.pop()
        self._taken.add(id(g))
        return g
