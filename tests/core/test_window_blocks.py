"""Sliding-window block release in the block manager (pure Python, no JAX).

Random walks of sequences growing by prefill chunks and decodes, forking, swapping out and
back, with prefix caching on, checked after every operation: the invariants hold, a sequence
never holds a block wholly behind its window, it holds every block inside it, and everything
comes back to the pool at the end.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import AllocStatus, BlockManager, Sequence, SequenceGroup
from pagedjax.core.block_manager import NULL_BLOCK


def _group(sid: int, prompt: list[int]) -> SequenceGroup:
    return SequenceGroup(f"r{sid}", [Sequence(sid, prompt)], 0.0)


def _advance(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Schedule n new tokens (a chunk or a decode), as the scheduler and runner do."""
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.mark_blocks_computed(seq)


def _check_window(bm: BlockManager, seq: Sequence, window: int) -> None:
    """Released slots lie wholly before what the next token can see (never a visible one)."""
    bs = bm.block_size
    first_visible = max(0, seq.num_computed_tokens - window + 1)
    for i, b in enumerate(bm.get_block_table(seq)):
        if b == NULL_BLOCK:
            assert (i + 1) * bs <= first_visible, (i, bm.get_block_table(seq))


def test_decode_holds_about_one_window():
    bm = BlockManager(64, 8, block_size=4, sliding_window=10)
    g = _group(1, list(range(30)))
    seq = g.seqs[0]
    bm.allocate(g)
    assert bm.num_held_blocks(seq) == 0  # lazy: the first chunk's append takes its blocks
    _advance(bm, seq, 30)
    assert bm.num_held_blocks(seq) == 8
    for t in range(50):
        seq.append_token(t)
        _advance(bm, seq, 1)
        _check_window(bm, seq, 10)
        # Released up to the window of the token just computed: at most 4 blocks remain.
        assert bm.num_held_blocks(seq) <= 10 // 4 + 2
        assert bm.get_block_table(seq)[: (seq.num_computed_tokens - 1 - 10 + 1) // 4] == \
            [NULL_BLOCK] * ((seq.num_computed_tokens - 1 - 10 + 1) // 4)
        bm.check_invariants()
    assert len(bm.get_block_table(seq)) == 20  # positions are never renumbered
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 64
    bm.check_invariants()


def test_no_window_releases_nothing():
    bm = BlockManager(64, 8, block_size=4)
    g = _group(2, list(range(30)))
    seq = g.seqs[0]
    bm.allocate(g)
    _advance(bm, seq, 30)
    for t in range(20):
        seq.append_token(t)
        _advance(bm, seq, 1)
    assert NULL_BLOCK not in bm.get_block_table(seq)
    assert bm.num_held_blocks(seq) == 13


def test_released_cached_block_still_serves_a_prefix_hit():
    """A block released by the window stays published: a new request with the same prefix
    reuses it (its KV is a function of the prefix, windowed or not)."""
    bm = BlockManager(32, 0, block_size=4, enable_prefix_caching=True, sliding_window=4)
    prompt = list(range(17))
    a = _group(3, prompt)
    bm.allocate(a)
    _advance(bm, a.seqs[0], 17)
    a.seqs[0].append_token(99)
    _advance(bm, a.seqs[0], 1)
    assert bm.get_block_table(a.seqs[0])[0] == NULL_BLOCK
    b = _group(4, prompt)
    assert bm.get_num_cached_tokens(b.seqs[0]) == 16
    bm.allocate(b)
    # Position 16 sees back to 13: hits behind block 3 are not even referenced.
    table_a, table_b = bm.get_block_table(a.seqs[0]), bm.get_block_table(b.seqs[0])
    assert table_b == [NULL_BLOCK] * 3 + [table_a[3]]
    assert b.seqs[0].num_computed_tokens == 16
    bm.check_invariants()
    _advance(bm, b.seqs[0], 1)
    assert bm.get_block_table(b.seqs[0])[3] == table_a[3]  # block 4 is new, block 3 shared
    bm.check_invariants()
    for g in (a, b):
        bm.free(g.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 32
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), window=st.integers(1, 24), bs=st.sampled_from([1, 2, 4, 8]),
       caching=st.booleans())
def test_random_walk_keeps_window_and_pool_whole(seed, window, bs, caching):
    rng = random.Random(seed)
    bm = BlockManager(400, 400, block_size=bs, enable_prefix_caching=caching,
                      sliding_window=window)
    live: list[Sequence] = []
    swapped: list[SequenceGroup] = []
    groups: dict[int, SequenceGroup] = {}
    next_id = 0
    base = [rng.randrange(50) for _ in range(40)]  # shared head: prefix hits
    for _ in range(120):
        op = rng.random()
        if op < 0.2 or not live:
            next_id += 1
            prompt = base[: rng.randrange(1, 40)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            g = _group(next_id, prompt)
            if bm.can_allocate(g) is not AllocStatus.OK:
                continue
            groups[next_id] = g
            bm.allocate(g)
            live.append(g.seqs[0])
        elif op < 0.65:
            seq = rng.choice(live)
            left = seq.num_total_tokens - seq.num_computed_tokens
            if not left:
                seq.append_token(rng.randrange(50))
            n = rng.randrange(1, left + 1) if left else 1  # a prefill chunk or a decode
            if bm.blocks_needed(seq, n) > bm.get_num_free_gpu_blocks():
                continue
            _advance(bm, seq, n)
            _check_window(bm, seq, window)
        elif op < 0.75:
            parent = rng.choice(live)
            next_id += 1
            child = parent.fork(next_id)
            bm.fork(parent, child)
            groups[next_id] = SequenceGroup(f"r{next_id}", [child], 0.0)
            live.append(child)
        elif op < 0.85:
            seq = rng.choice(live)
            g = groups[seq.seq_id]
            if bm.can_swap_out(g):
                bm.swap_out(g)
                live.remove(seq)
                swapped.append(g)
        elif op < 0.92 and swapped:
            g = swapped[rng.randrange(len(swapped))]
            if not bm.can_swap_in(g):
                continue
            swapped.remove(g)
            bm.swap_in(g)
            live.append(g.seqs[0])
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants()
    for seq in live + [g.seqs[0] for g in swapped]:
        bm.free(seq)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 400 and bm.get_num_free_cpu_blocks() == 400


@pytest.mark.parametrize("chunk", [8, 16, 48])
def test_chunked_prefill_holds_window_plus_chunk(chunk):
    """A 400-token prompt computed in chunks never holds more than the blocks from the window
    behind a chunk to the chunk's end, and admission asks only for the first chunk."""
    bs, window = 4, 12
    bm = BlockManager(200, 0, block_size=bs, sliding_window=window, max_chunk_tokens=chunk)
    g = _group(7, list(range(400)))
    seq = g.seqs[0]
    free = bm.get_num_free_gpu_blocks()
    bm.allocate(g)
    bound = -(-(window - 1 + chunk) // bs) + 1
    assert bm.worst_case_blocks(400, 410, 1) == bound
    peak = 0
    while seq.num_uncomputed_tokens:
        n = min(chunk, seq.num_uncomputed_tokens)
        assert bm.blocks_needed(seq, n) <= bound
        _advance(bm, seq, n)
        peak = max(peak, bm.num_held_blocks(seq))
        _check_window(bm, seq, window)
        bm.check_invariants()
    assert peak <= bound
    assert peak >= -(-chunk // bs)  # a whole chunk is written at once
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == free
    bm.check_invariants()


def test_admission_asks_for_the_first_chunk_only():
    bm = BlockManager(20, 0, block_size=4, sliding_window=8, max_chunk_tokens=16, watermark=0)
    # 400 tokens would need 100 blocks eagerly; the first chunk needs 4 of the 20.
    assert bm.can_allocate(_group(8, list(range(400)))) is AllocStatus.OK
    eager = BlockManager(20, 0, block_size=4, watermark=0)
    assert eager.can_allocate(_group(9, list(range(400)))) is AllocStatus.NEVER


def test_negative_window_rejected():
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(8, 0, block_size=4, sliding_window=-1)
