"""Host-side construction of one step's padded arrays from the scheduler's output.

Shapes come from the runner's `ShapePlan` (pagedjax/worker/shapes.py), a fixed set that
warm-up compiles, so serving never recompiles. Everything here is numpy: the only device
transfer is the final `device_put`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from pagedjax.core.scheduler import PENDING_TOKEN, ScheduledSeq, SchedulerOutput
from pagedjax.worker.input_batch import InputBatch
from pagedjax.worker.paged_attention import PagedMeta
from pagedjax.worker.shapes import ShapePlan, pow2_at_least


def bucket(n: int, minimum: int) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass
class StepInputs:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    meta: PagedMeta  # numpy leaves
    logits_indices: np.ndarray  # [R]: flat token index of each sampled row
    sample_seq_pos: list[int]  # for each real sampled row, the index into `scheduled`
    shape_key: tuple[int, int, int, int, bool]
    # Async scheduling: for each token, the row of the previous step's sampled tokens that
    # holds its id (-1: `input_ids` has it), and those tokens on the device.
    prev_rows: np.ndarray | None = None
    prev_tokens: object = None
    # Block tables kept on the device (`InputBatch(device_tables=True)`): `meta.block_tables`
    # is None, each sequence's persistent row is here ([S], padding 0), and the runner takes
    # the batch's queued row writes when it dispatches the step.
    table_rows: np.ndarray | None = None
    table_source: InputBatch | None = None


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int, max_blocks_per_seq: int,
                      rows_per_seq: list[int] | None = None,
                      extra_rows: list[int] | None = None,
                      plan: ShapePlan | None = None,
                      batch: InputBatch | None = None,
                      num_groups: int = 1,
                      spec_lens: list[int] | None = None,
                      num_tokens: int | None = None) -> StepInputs:
    """Flatten scheduled sequences into a ragged token batch.

    `rows_per_seq[i]` is how many sampled rows sequence i needs (0 when it is mid-prefill,
    n when a prompt fans out into n samples); default: 1 if `needs_logits` else 0.
    `extra_rows` are flat token indices whose logits are wanted too (prompt logprobs); they
    follow the sampled rows in `logits_indices`. `plan` fixes the padded shapes (default: a
    plan sized for this batch, for tools that build one step by hand). `batch` (the engine's
    persistent `InputBatch`) supplies the block tables by deltas; without it each table is
    copied whole. `spec_lens[i]` > 0 (speculative decoding): sequence i ends with that many
    draft tokens and its `1 + spec_lens[i]` logits rows are its last token positions, one
    each, instead of copies of the last one. `num_tokens`: the step's token count when the
    caller knows it (`SchedulerOutput.num_batched_tokens`), which spares a decode step
    counting. `num_groups` > 1 (a hybrid model's KV-cache
    groups, `core.kv_groups`): block tables are `[G, S, M]` and slot mappings `[G, T]`, one
    per group; a sequence's `block_table` is then one table per group (a plain list, as
    hand-built steps give, is used for every group).
    Vectorised over tokens: the only per-sequence Python work is its block table row (host
    overhead is on the critical path of every step).
    """
    num_seqs = len(scheduled)
    if (num_tokens == num_seqs and num_groups == 1 and batch is not None and batch.device_tables
            and plan is not None and not extra_rows and not (spec_lens and any(spec_lens))
            and rows_per_seq is not None and rows_per_seq.count(1) == num_seqs):
        return _decode_inputs(scheduled, block_size, plan, batch)
    # List comprehensions, not generator expressions or `map(attrgetter)`: in CPython 3.12
    # they are the cheapest pass over a step's entries (this runs for every entry of every
    # step; `bench/host_overhead.py`).
    if num_tokens == num_seqs:  # a decode step (every entry has at least one token)
        q_lens = np.ones(num_seqs, np.int32)
    else:
        q_lens = np.array([len(s.token_ids) for s in scheduled], np.int32)
    start_pos = np.array([s.start_pos for s in scheduled], np.int32)
    total = int(q_lens.sum())
    decode_only = total == num_seqs
    if num_groups > 1:
        max_blocks = max(max(len(t) for t in _group_tables(s.block_table, num_groups))
                         for s in scheduled)
    else:
        max_blocks = max([len(s.block_table) for s in scheduled])
    if plan is None:
        plan = ShapePlan(max(num_seqs, 8), max(total, 16), max(max_blocks_per_seq, max_blocks),
                         fixed_width=False)
    if rows_per_seq is None:
        rows = np.fromiter((1 if s.needs_logits else 0 for s in scheduled), np.int32, num_seqs)
    else:
        rows = np.asarray(rows_per_seq, np.int32)
    num_rows = int(rows.sum())
    n_extra = len(extra_rows or ())
    if decode_only:
        t_pad, s_pad, r_pad = plan.decode(num_seqs)
    else:
        t_pad, s_pad, r_pad = plan.mixed(total, num_seqs, n_extra)
    if num_rows + n_extra > r_pad:
        # Speculation: up to 1 + k rows per sequence, never more than the step's tokens
        # (`ShapePlan.step_shapes` has R = T); otherwise hand-built steps only.
        r_pad = t_pad if num_rows + n_extra <= t_pad else pow2_at_least(num_rows + n_extra)
    m_pad = plan.width(max_blocks)

    cu_q_lens = np.full(s_pad + 1, total, np.int32)
    cu_q_lens[0] = 0
    np.cumsum(q_lens, out=cu_q_lens[1 : num_seqs + 1])
    table_rows = None
    if batch is not None and batch.device_tables:
        # Only the rows travel; slots come from the host copy of the rows.
        table_rows = np.zeros(s_pad, np.int32)
        table_rows[:num_seqs] = batch.rows(scheduled)
        block_tables = None
    elif batch is not None:
        block_tables = batch.block_tables(scheduled, s_pad, m_pad)
    elif num_groups > 1:
        block_tables = np.zeros((num_groups, s_pad, m_pad), np.int32)
        for i, s in enumerate(scheduled):
            for g, t in enumerate(_group_tables(s.block_table, num_groups)):
                block_tables[g, i, : len(t)] = t
    else:
        block_tables = np.zeros((s_pad, m_pad), np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_table)] = s.block_table

    seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens)
    pos = start_pos[seq_of_token] + (np.arange(total, dtype=np.int32) - cu_q_lens[seq_of_token])
    input_ids = np.zeros(t_pad, np.int32)
    if num_tokens == num_seqs:  # one token each
        input_ids[:total] = [s.token_ids[0] for s in scheduled]
    else:
        input_ids[:total] = np.fromiter(
            itertools.chain.from_iterable([s.token_ids for s in scheduled]), np.int32, total)
    positions = np.zeros(t_pad, np.int32)
    positions[:total] = pos
    if table_rows is None:
        slot_mapping = np.full(block_tables.shape[:-2] + (t_pad,), -1, np.int32)
        blocks = block_tables[..., seq_of_token, pos // block_size]
    else:
        slot_mapping = np.full((num_groups, t_pad) if num_groups > 1 else (t_pad,), -1,
                               np.int32)
        blocks = batch.host_tables[table_rows[seq_of_token], :, pos // block_size].T
        blocks = blocks if num_groups > 1 else blocks[0]
    slot_mapping[..., :total] = blocks * block_size + pos % block_size
    kv_lens = np.zeros(s_pad, np.int32)
    kv_lens[:num_seqs] = start_pos + q_lens

    last_token = cu_q_lens[1 : num_seqs + 1] - 1
    logits_rows = np.repeat(last_token, rows)
    if spec_lens and any(spec_lens):
        offsets = np.concatenate([np.arange(-k, 1) if k else np.zeros(r, np.int32)
                                  for k, r in zip(spec_lens, rows.tolist(), strict=True)])
        logits_rows = logits_rows + offsets.astype(np.int32)
    if extra_rows:
        logits_rows = np.concatenate([logits_rows, np.asarray(extra_rows, np.int32)])
    logits_indices = np.zeros(r_pad, np.int32)
    logits_indices[: len(logits_rows)] = logits_rows
    sample_seq_pos = np.repeat(np.arange(num_seqs), rows).tolist()
    meta = PagedMeta(slot_mapping, kv_lens, block_tables, cu_q_lens, np.int32(num_seqs), decode_only)
    return StepInputs(input_ids, positions, meta, logits_indices, sample_seq_pos,
                      (t_pad, s_pad, m_pad, r_pad, decode_only), table_rows=table_rows,
                      table_source=batch if table_rows is not None else None)


def _decode_inputs(scheduled: list[ScheduledSeq], block_size: int, plan: ShapePlan,
                   batch: InputBatch) -> StepInputs:
    """`build_step_inputs` for the step the engine runs most: one token and one sampled row
    per sequence, one KV group, tables on the device. Token i is sequence i's, so the ragged
    bookkeeping (token -> sequence, cumulative lengths, repeats) is a few ranges; the same
    arrays as the general path (`tests/engine/test_step_inputs.py`)."""
    return _one_token_inputs(len(scheduled), [s.start_pos for s in scheduled],
                             [s.token_ids[0] for s in scheduled],
                             max([len(s.block_table) for s in scheduled]),
                             batch.rows(scheduled), block_size, plan, batch)


def steady_decode_inputs(sched: SchedulerOutput, block_size: int, plan: ShapePlan,
                         batch: InputBatch) -> StepInputs:
    """`_decode_inputs` for a steady step (`SchedulerOutput.steady`) from its columns, the
    rows kept per cohort (`InputBatch.steady_rows`): no pass over `ScheduledSeq` entries.
    The same arrays (`tests/engine/test_steady_decode.py`)."""
    run = sched.steady
    n = len(run.starts)
    return _one_token_inputs(n, run.starts,
                             PENDING_TOKEN if run.token_ids is None else run.token_ids,
                             max(map(len, run.cohort.tables)),
                             batch.steady_rows(run, lambda: sched.scheduled), block_size, plan,
                             batch)


def _one_token_inputs(n: int, starts: list[int], token_ids: list[int] | int, max_blocks: int,
                      rows, block_size: int, plan: ShapePlan, batch: InputBatch) -> StepInputs:
    """The arrays of a step of ``n`` sequences, one token and one sampled row each."""
    t_pad = plan.decode(n)[0]  # T = S = R
    start_pos = np.array(starts, np.int32)
    m_pad = plan.width(max_blocks)
    table_rows = np.zeros(t_pad, np.int32)
    table_rows[:n] = rows
    input_ids = np.zeros(t_pad, np.int32)
    input_ids[:n] = token_ids
    positions = np.zeros(t_pad, np.int32)
    positions[:n] = start_pos
    slot_mapping = np.full(t_pad, -1, np.int32)
    slot_mapping[:n] = (batch.host_tables[table_rows[:n], 0, start_pos // block_size] * block_size
                        + start_pos % block_size)
    kv_lens = np.zeros(t_pad, np.int32)
    kv_lens[:n] = start_pos + 1
    cu_q_lens, logits_indices, sample_pos = _one_token_layout(n, t_pad)
    meta = PagedMeta(slot_mapping, kv_lens, None, cu_q_lens, np.int32(n), True)
    return StepInputs(input_ids, positions, meta, logits_indices, sample_pos,
                      (t_pad, t_pad, m_pad, t_pad, True), table_rows=table_rows,
                      table_source=batch)


@functools.lru_cache(maxsize=256)
def _one_token_layout(n: int, t_pad: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """What a step of ``n`` sequences of one token each lays out the same way every time:
    the cumulative query lengths, the logits rows, the sampled rows' entries. Kept per
    (n, bucket), read-only (a writer fails instead of changing the next step's)."""
    cu_q_lens = np.full(t_pad + 1, n, np.int32)
    cu_q_lens[: n + 1] = np.arange(n + 1, dtype=np.int32)
    logits_indices = np.zeros(t_pad, np.int32)
    logits_indices[:n] = cu_q_lens[:n]
    cu_q_lens.flags.writeable = False
    logits_indices.flags.writeable = False
    return cu_q_lens, logits_indices, _ReadOnlyList(range(n))


class _ReadOnlyList(list):
    """A shared list its readers must not change."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a shared step layout is read-only")

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


def _group_tables(table, num_groups: int):
    """One table per KV-cache group: a tuple as the hybrid manager gives, or one list for all."""
    return table if isinstance(table, tuple) else (table,) * num_groups
