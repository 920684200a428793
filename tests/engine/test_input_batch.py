"""The persistent batch's block tables (`pagedjax/worker/input_batch.py`): deltas only where
a table only grew, whole rows (stale tails zeroed) where it changed, and never a stale id.
The scheduler property tests check it against the live tables every step (tests/core/core_sim.py)."""

import numpy as np
import pytest

from pagedjax.core import BlockManager, Sequence, SequenceGroup
from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.worker.input_batch import InputBatch


def _sched(bm: BlockManager, seq: Sequence) -> ScheduledSeq:
    table, version = bm.get_block_table_ref(seq)
    return ScheduledSeq(seq.seq_id, "r", [0], seq.num_computed_tokens, table, True, version)


def _want(scheduled, s_pad, m_pad):
    out = np.zeros((s_pad, m_pad), np.int32)
    for i, s in enumerate(scheduled):
        out[i, : len(s.block_table)] = s.block_table
    return out


def test_decode_growth_is_written_by_deltas():
    bm = BlockManager(64, 0, block_size=4)
    seq = Sequence(0, list(range(5)))
    bm.allocate(SequenceGroup("a", [seq], 0.0))
    batch = InputBatch(16)
    seq.num_computed_tokens = 5
    for step in range(20):
        s = _sched(bm, seq)
        assert (batch.block_tables([s], 2, 16) == _want([s], 2, 16)).all()
        seq.append_token(step)
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
    assert batch.num_rewrites == 1  # the first sight only; 4 appended blocks were deltas


def test_copy_on_write_rewrites_the_row():
    bm = BlockManager(64, 0, block_size=4)
    parent = Sequence(0, list(range(6)))
    bm.allocate(SequenceGroup("a", [parent], 0.0))
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    bm.fork(parent, child)
    batch = InputBatch(16)
    before = batch.block_tables([_sched(bm, child)], 1, 4).copy()
    assert bm.append_slots(child, 1)  # the shared half-full block is copied
    after = _sched(bm, child)
    got = batch.block_tables([after], 1, 4)
    assert (got == _want([after], 1, 4)).all()
    assert got[0, 1] != before[0, 1]  # the row follows the copy, not the shared block
    assert batch.num_rewrites == 2


def test_reused_row_has_no_stale_ids_and_unknown_versions_rewrite():
    batch = InputBatch(8, max_rows=64)
    long = ScheduledSeq(0, "a", [0], 0, [7, 7, 7, 7, 7], True, 10)
    assert (batch.block_tables([long], 1, 8)[0] == [7, 7, 7, 7, 7, 0, 0, 0]).all()
    batch.release([0])
    short = ScheduledSeq(1, "b", [0], 0, [3], True, 11)  # takes the released row
    assert (batch.block_tables([short], 1, 8)[0] == [3, 0, 0, 0, 0, 0, 0, 0]).all()
    # No version (-1, hand-built or a baseline KV manager): rewritten every time.
    hand = ScheduledSeq(2, "c", [0], 0, [5, 6], True)
    batch.block_tables([hand], 1, 8)
    hand.block_table[0] = 9
    assert batch.block_tables([hand], 1, 8)[0, 0] == 9


def test_missed_releases_are_swept_and_rows_rebuilt():
    batch = InputBatch(4, max_rows=4)
    rng = np.random.default_rng(0)
    for step in range(50):  # new sequences every step, never released
        scheduled = [ScheduledSeq(100 * step + i, "r", [0], 0,
                                  [int(x) for x in rng.integers(0, 99, rng.integers(1, 5))],
                                  True, 1000 * step + i) for i in range(3)]
        assert (batch.block_tables(scheduled, 4, 4) == _want(scheduled, 4, 4)).all()
        assert len(batch) <= 4 + 3


def test_table_wider_than_the_batch_is_refused():
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        InputBatch(2).block_tables([ScheduledSeq(0, "a", [0], 0, [1, 2, 3], True, 1)], 1, 4)


def test_penalty_histories_follow_the_token_lists():
    rng = np.random.default_rng(1)
    batch = InputBatch(8)
    seqs = [Sequence(i, [int(x) for x in rng.integers(0, 50, rng.integers(1, 40))])
            for i in range(6)]
    for step in range(300):
        seq = seqs[int(rng.integers(len(seqs)))]
        for _ in range(int(rng.integers(0, 4))):
            seq.append_token(int(rng.integers(0, 50)))
        if rng.random() < 0.05:  # a fork: a new sequence with a copy of the history
            seqs.append(seq.fork(100 + step))
        prompt, out = batch.histories(seq)
        assert prompt.dtype == out.dtype == np.int32
        assert prompt.tolist() == seq.prompt_token_ids and out.tolist() == seq.output_token_ids
        if rng.random() < 0.05:
            batch.release([seq.seq_id])
