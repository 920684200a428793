"""KV-cache groups of hybrid models (pure Python, no JAX).

The layout splits mixed local/global layers into equal groups; the hybrid manager keeps one
table per group over one shared pool. Random walks (chunks, decodes, forks, swaps, frees,
prefix caching, pinned prefixes) are checked after every operation: the union of the groups'
references equals the pool's ref counts, windowed groups never hold a block wholly behind
their window and hold every block inside it, the global group holds every block, and the pool
is whole at the end.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import AllocStatus, Sequence, SequenceGroup
from pagedjax.core.block_manager import NULL_BLOCK
from pagedjax.core.hybrid_kv_manager import HybridBlockManager
from pagedjax.core.kv_groups import plan_kv_groups


def _group(sid: int, prompt: list[int]) -> SequenceGroup:
    return SequenceGroup(f"r{sid}", [Sequence(sid, prompt)], 0.0)


def _advance(bm, seq: Sequence, n: int) -> None:
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.mark_blocks_computed(seq)


# -- layout -----------------------------------------------------------------------------

def test_gemma3_layout_five_local_per_global():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    lay = plan_kv_groups(windows)
    assert lay.num_slots == 3 and lay.num_groups == 6
    assert lay.group_windows == (512,) * 5 + (0,)
    assert lay.layers_of_group(5) == [5, 11, 17]
    assert lay.layers_of_group(0) == [0, 1, 2]


def test_uneven_kinds_pad_the_last_group():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))  # Gemma 3 1B: 4 + 22
    lay = plan_kv_groups(windows)
    assert lay.num_slots == 4 and lay.num_groups == 7
    assert lay.layers_of_group(5) == [24, 25]  # 2 of 4 slots idle
    assert lay.layers_of_group(6) == [5, 11, 17, 23]


@given(st.lists(st.sampled_from([0, 4, 4, 9]), min_size=1, max_size=40), st.booleans())
def test_layout_is_a_bijection_onto_group_slots(windows, hybrid):
    windows = tuple(windows)
    lay = plan_kv_groups(windows, hybrid)
    pairs = list(zip(lay.group_of_layer, lay.slot_of_layer, strict=True))
    assert len(set(pairs)) == len(windows)  # no two layers share a (table, slot)
    assert all(0 <= s < lay.num_slots for s in lay.slot_of_layer)
    for layer, g in enumerate(lay.group_of_layer):
        w = lay.group_windows[g]
        assert w == windows[layer] or (not lay.hybrid and (w == 0 or w >= windows[layer]))
    if not lay.hybrid:
        assert lay.num_slots == len(windows)
    if lay.hybrid:
        assert hybrid and 0 in windows and any(windows)
        # Storage: groups x slots never exceeds twice the layers (padding < one group per kind).
        assert lay.num_groups * lay.num_slots < len(windows) + len(set(windows)) * lay.num_slots


def test_layout_refuses_bad_windows():
    with pytest.raises(ValueError, match="windows"):
        plan_kv_groups((0, -1))


# -- manager ----------------------------------------------------------------------------

def _check_groups(bm: HybridBlockManager, seq: Sequence) -> None:
    bs = bm.block_size
    n = seq.num_computed_tokens
    for w, table in zip(bm.group_windows, bm.get_block_table(seq), strict=True):
        if not w:
            assert NULL_BLOCK not in table
            continue
        first_visible = max(0, n - w + 1)
        for i, b in enumerate(table):
            if b == NULL_BLOCK:
                assert (i + 1) * bs <= first_visible
            elif i * bs < n:
                pass  # a held block may be a little behind (released at the next append)
        # Every block the next token can see is held.
        for i in range(first_visible // bs, min(len(table), -(-n // bs))):
            assert table[i] != NULL_BLOCK


def test_long_decode_local_groups_hold_a_window():
    bm = HybridBlockManager((8, 8, 0), 200, 0, block_size=4, max_chunk_tokens=16)
    g = _group(1, list(range(40)))
    seq = g.seqs[0]
    bm.allocate(g)
    while seq.num_uncomputed_tokens:
        _advance(bm, seq, min(16, seq.num_uncomputed_tokens))
    for t in range(200):
        seq.append_token(t % 50)
        _advance(bm, seq, 1)
        _check_groups(bm, seq)
        bm.check_invariants()
    local = [bm.groups[i].num_held_blocks(seq) for i in (0, 1)]
    assert all(x <= 8 // 4 + 2 for x in local)
    assert bm.groups[2].num_held_blocks(seq) == 60  # 240 tokens, global keeps them all
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 200
    bm.check_invariants()


def test_prefix_hit_is_shared_by_every_group():
    bm = HybridBlockManager((4, 0), 64, 0, block_size=4, enable_prefix_caching=True)
    prompt = list(range(21))
    a = _group(1, prompt)
    bm.allocate(a)
    _advance(bm, a.seqs[0], 21)
    b = _group(2, prompt + [7, 7])
    assert bm.get_num_cached_tokens(b.seqs[0]) == 20
    bm.allocate(b)
    ta, tb = bm.get_block_table(a.seqs[0]), bm.get_block_table(b.seqs[0])
    assert tb[1][:5] == ta[1][:5]  # global: every cached block shared
    assert tb[0][:4] == [NULL_BLOCK] * 4 and tb[0][4] == ta[0][4]  # local: only the window
    assert set(tb[0]) & set(ta[1]) == set()  # groups never share a block
    bm.check_invariants()
    for g in (a, b):
        bm.free(g.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 64
    bm.check_invariants()


def test_evicted_local_chain_shortens_the_hit():
    """A local group's early blocks, released and evicted, cut the hit for every group."""
    bm = HybridBlockManager((4, 0), 17, 0, block_size=4, enable_prefix_caching=True,
                            watermark=0)
    prompt = list(range(16))
    a = _group(1, prompt)
    bm.allocate(a)
    _advance(bm, a.seqs[0], 16)
    a.seqs[0].append_token(1)
    _advance(bm, a.seqs[0], 1)  # local blocks 0..2 released, still cached; 7 held
    b = _group(3, prompt + [5])
    assert bm.get_num_cached_tokens(b.seqs[0]) == 16
    filler = _group(2, [99] * 16)
    bm.allocate(filler)
    _advance(bm, filler.seqs[0], 16)  # 8 blocks: the 7 never-cached ones, then the LRU one
    bm.free(filler.seqs[0])
    assert bm.get_num_cached_tokens(b.seqs[0]) == 0  # local block 0 is gone
    assert bm.can_allocate(b) is AllocStatus.OK
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    bm.check_invariants()
    for g in (a, b):
        bm.free(g.seqs[0])
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 17


def test_pinned_prefix_pins_every_group():
    bm = HybridBlockManager((4, 0), 64, 0, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))
    h = bm.register_prefix(prompt)
    assert not h.complete
    a = _group(1, prompt + [1])
    bm.allocate(a)
    _advance(bm, a.seqs[0], 13)
    assert h.complete
    bm.free(a.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 64 - 6  # 3 blocks pinned in each group
    bm.unpin(h)
    assert not h.valid
    assert bm.get_num_free_gpu_blocks() == 64
    bm.check_invariants()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), windows=st.sampled_from([(5, 0), (3, 3, 0), (9, 0, 4)]),
       bs=st.sampled_from([1, 2, 4]), caching=st.booleans(),
       chunk=st.sampled_from([None, 3, 8]))
def test_random_walk_keeps_groups_and_pool_whole(seed, windows, bs, caching, chunk):
    rng = random.Random(seed)
    bm = HybridBlockManager(windows, 300, 300, block_size=bs, enable_prefix_caching=caching,
                            max_chunk_tokens=chunk)
    live: list[Sequence] = []
    swapped: list[SequenceGroup] = []
    groups: dict[int, SequenceGroup] = {}
    handles = []
    next_id = 0
    base = [rng.randrange(30) for _ in range(30)]
    for _ in range(120):
        op = rng.random()
        if op < 0.2 or not live:
            next_id += 1
            g = _group(next_id, base[: rng.randrange(1, 30)] + [rng.randrange(30)] * rng.randrange(3))
            if bm.can_allocate(g) is not AllocStatus.OK:
                continue
            groups[next_id] = g
            bm.allocate(g)
            live.append(g.seqs[0])
        elif op < 0.65:
            seq = rng.choice(live)
            left = seq.num_uncomputed_tokens
            if not left:
                seq.append_token(rng.randrange(30))
            n = rng.randrange(1, min(left, chunk or left) + 1) if left else 1
            if bm.blocks_needed(seq, n) > bm.get_num_free_gpu_blocks():
                continue
            _advance(bm, seq, n)
            _check_groups(bm, seq)
        elif op < 0.72:
            parent = rng.choice(live)
            next_id += 1
            child = parent.fork(next_id)
            bm.fork(parent, child)
            groups[next_id] = SequenceGroup(f"r{next_id}", [child], 0.0)
            live.append(child)
        elif op < 0.8:
            seq = rng.choice(live)
            g = groups[seq.seq_id]
            if bm.can_swap_out(g):
                bm.swap_out(g)
                live.remove(seq)
                swapped.append(g)
        elif op < 0.87 and swapped:
            g = swapped[rng.randrange(len(swapped))]
            if bm.can_swap_in(g):
                swapped.remove(g)
                bm.swap_in(g)
                live.append(g.seqs[0])
        elif op < 0.9 and caching:
            if handles and rng.random() < 0.5:
                bm.unpin(handles.pop())
            else:
                handles.append(bm.register_prefix(base[: rng.randrange(1, 30)]))
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
    for seq in live + [g.seqs[0] for g in swapped]:
        bm.free(seq)
    for h in handles:
        bm.unpin(h)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 300 and bm.get_num_free_cpu_blocks() == 300
