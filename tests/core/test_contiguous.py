"""Buddy allocator, contiguous reservation policies, static batching (pure Python)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from pagedjax.baselines.buddy_allocator import BuddyAllocator, next_pow2
from pagedjax.baselines.contiguous import ContiguousKVManager
from pagedjax.baselines.static_batching import StaticBatchScheduler
from pagedjax.core import AllocStatus, Scheduler, SchedulerConfig, Sequence, SequenceGroup
from pagedjax.core.kv_accounting import snapshot
from pagedjax.core.policies import KV_POLICIES, make_kv_manager, make_scheduler
from pagedjax.core.sequence import SequenceStatus

_ids = iter(range(10**9))


def group(prompt_len: int, max_tokens: int | None, rid: str | None = None, n: int = 1) -> SequenceGroup:
    sid = next(_ids)
    return SequenceGroup(rid or f"r{sid}", [Sequence(sid, [1] * prompt_len)], 0.0, max_tokens=max_tokens, n=n)


# -- buddy allocator -------------------------------------------------------------
def test_next_pow2() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]


def test_split_and_merge_back() -> None:
    b = BuddyAllocator(16)
    a = b.allocate(3)  # rounded to 4
    assert (a, b.size_of(a)) == (0, 4)
    c = b.allocate(1)
    assert c == 4 and b.num_free == 11
    assert b.largest_free_run() == 8
    b.check_invariants()
    b.free(a)
    b.free(c)
    assert b.largest_free_run() == 16 and b.num_free == 16
    b.check_invariants()


def test_external_fragmentation_blocks_large_request() -> None:
    """Half the pool is free, but no aligned run of 8 exists: the request must wait."""
    b = BuddyAllocator(16)
    starts = [b.allocate(2) for _ in range(8)]
    for s in starts[::2]:
        b.free(s)
    assert b.num_free == 8
    assert not b.can_allocate(4) and b.can_allocate(2)
    with pytest.raises(MemoryError):
        b.allocate(4)


def test_non_pow2_pool_has_top_level_chunks() -> None:
    b = BuddyAllocator(48)  # [0,32) + [32,48)
    assert b.largest_free_run() == 32
    assert not b.fits_ever(33) and b.fits_ever(32)
    x, y = b.allocate(32), b.allocate(16)
    assert (x, y) == (0, 32) and b.num_free == 0
    b.free(y)
    b.free(x)
    assert b.num_free == 48
    b.check_invariants()


@settings(max_examples=150, deadline=None)
@given(hst.integers(1, 70), hst.lists(hst.tuples(hst.booleans(), hst.integers(1, 20)), max_size=60))
def test_buddy_property(pool: int, ops: list[tuple[bool, int]]) -> None:
    """Random alloc/free keeps the pool tiled, merged, and fully recoverable."""
    b = BuddyAllocator(pool)
    live: list[int] = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            if b.can_allocate(size):
                s = b.allocate(size)
                assert b.size_of(s) == next_pow2(size)
                live.append(s)
            else:
                with pytest.raises(MemoryError):
                    b.allocate(size)
        else:
            b.free(live.pop(size % len(live)))
        b.check_invariants()
        assert b.num_free + sum(b.size_of(s) for s in live) == pool
    for s in live:
        b.free(s)
    b.check_invariants()
    assert b.num_free == pool and b.largest_free_run() == 1 << (pool.bit_length() - 1)


# -- reservation rules ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "prompt", "out", "tokens", "blocks"),
    [
        ("max", 10, 5, 256, 16),  # always max_model_len
        ("oracle", 10, 5, 15, 1),  # prompt + true output
        ("oracle", 30, 20, 50, 4),  # 4 blocks of 16 (buddy rounds 3.125 -> 4)
        ("pow2", 10, 5, 18, 2),  # 10 + next_pow2(5) = 18
        ("pow2", 30, 33, 94, 8),  # 30 + 64
        ("pow2", 200, 100, 256, 16),  # capped at max_model_len
    ],
)
def test_reservation_rule(policy: str, prompt: int, out: int, tokens: int, blocks: int) -> None:
    bm = ContiguousKVManager(64, 0, 16, policy=policy, max_model_len=256)
    g = group(prompt, out)
    seq = g.seqs[0]
    assert bm.reservation_tokens(seq, g) == tokens
    bm.allocate(g)
    r = bm.region(seq)
    assert r.num_blocks == blocks
    table = bm.get_block_table(seq)
    assert table == list(range(r.start, r.start + len(table)))  # a contiguous range
    assert len(table) == -(-prompt // 16)
    bm.check_invariants()


def test_table_covers_pending_tokens_and_drafts() -> None:
    """With async scheduling a sequence's sampled-but-unapplied token is written by the next
    step one slot past its known tokens: the table must reach the block that slot starts
    (it did not, and the baselines gave wrong tokens under async scheduling)."""
    bm = ContiguousKVManager(64, 0, 16, policy="max", max_model_len=256)
    g = group(16, 40)  # the prompt fills exactly one block
    seq = g.seqs[0]
    bm.allocate(g)
    assert len(bm.get_block_table(seq)) == 1
    seq.num_pending = 1  # token 17's KV goes to the second block
    assert len(bm.get_block_table(seq)) == 2
    seq.num_pending = 0
    seq.spec_token_ids = [5] * 17  # drafts count too: 16 + 17 tokens -> 3 blocks
    assert len(bm.get_block_table(seq)) == 3
    r = bm.region(seq)
    assert bm.get_block_table(seq) == list(range(r.start, r.start + 3))


def test_oracle_without_max_tokens_reserves_max_len() -> None:
    bm = ContiguousKVManager(64, 0, 16, policy="oracle", max_model_len=128)
    g = group(10, None)
    assert bm.reservation_tokens(g.seqs[0], g) == 128


def test_region_never_grows_and_admission_waits() -> None:
    bm = ContiguousKVManager(8, 0, 4, policy="oracle", max_model_len=64)
    a, b = group(6, 10), group(6, 10)  # 16 tokens -> 4 blocks each
    assert bm.can_allocate(a) is AllocStatus.OK
    bm.allocate(a)
    bm.allocate(b)
    assert bm.can_allocate(group(1, 1)) is AllocStatus.LATER
    assert bm.can_allocate(group(30, 10)) is AllocStatus.NEVER
    seq = a.seqs[0]
    assert bm.can_append_slots(a) and bm.append_slots(seq, 6) == []
    seq.num_computed_tokens = 16
    assert not bm.can_append_slots(a, 1)  # past the final length: no growth
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 4
    bm.check_invariants()


def test_fork_copies_into_reserved_spare() -> None:
    bm = ContiguousKVManager(32, 0, 4, policy="oracle", max_model_len=64)
    g = group(6, 2, n=2)  # 8 tokens -> 2 blocks, plus one spare region for the child
    bm.allocate(g)
    assert bm.get_num_free_gpu_blocks() == 28
    parent = g.seqs[0]
    parent.num_computed_tokens = 6
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    p, c = bm.region(parent), bm.region(child)
    assert bm.append_slots(child, 1) == [(p.start, c.start), (p.start + 1, c.start + 1)]
    assert bm.append_slots(child, 1) == []
    bm.check_invariants()


def test_beam_fork_after_free_reuses_the_dropped_region_on_a_full_pool() -> None:
    """A beam step on a full pool: a parent's second child fits only in the region of a beam
    dropped in the same step, so the engine frees dropped beams before it forks."""
    bm = ContiguousKVManager(8, 0, 4, policy="oracle", max_model_len=64)
    g = group(6, 2, n=4)  # 8 tokens -> 2 blocks per beam; 4 regions fill the pool
    bm.allocate(g)
    assert bm.get_num_free_gpu_blocks() == 0
    first = g.seqs[0]
    first.num_computed_tokens = 6
    beams = [first]
    for _ in range(3):  # first beam step: the children take the spares reserved at admission
        child = first.fork(next(_ids))
        bm.fork(first, child)
        beams.append(child)
    for b in beams:  # the step that computes every beam's first output token
        bm.append_slots(b, 1)
        b.append_token(5)
        b.num_computed_tokens = 7
    parent, dropped = beams[0], beams[3]  # next beam step: beam 0 survives twice, beam 3 not at all
    child = parent.fork(next(_ids))
    with pytest.raises(MemoryError):
        bm.fork(parent, child)  # fork before free: the dropped beam still holds its region
    bm.check_invariants()
    freed = bm.region(dropped)
    bm.free(dropped)
    bm.fork(parent, child)
    p, c = bm.region(parent), bm.region(child)
    assert (c.start, c.num_blocks) == (freed.start, p.num_blocks)
    assert bm.get_num_free_gpu_blocks() == 0
    # Mid-generation fork: both blocks holding the 7 computed tokens (the last one partial) are copied.
    assert bm.append_slots(child, 1) == [(p.start, c.start), (p.start + 1, c.start + 1)]
    bm.check_invariants()
    for b in (*beams[:3], child):
        bm.free(b)
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()


# -- accounting and schedulers ---------------------------------------------------------------
def test_memory_breakdown_contiguous() -> None:
    bm = ContiguousKVManager(16, 0, 4, policy="pow2", max_model_len=64)
    g = group(6, 5)  # final 11; reserve 6 + 8 = 14 -> 4 blocks = 16 slots
    bm.allocate(g)
    g.seqs[0].num_computed_tokens = 6
    snap = snapshot(bm, [g], num_waiting=1, max_model_len=64)
    assert snap == {"token_states": 6, "reserved": 5, "internal": 3, "external": 2 + 48, "free": 0}


def test_memory_breakdown_paged() -> None:
    bm = make_kv_manager("paged", 16, 0, 4, max_model_len=64)
    g = group(6, 5)
    bm.allocate(g)
    g.seqs[0].num_computed_tokens = 6
    snap = snapshot(bm, [g], num_waiting=0, max_model_len=64)
    assert snap == {"token_states": 6, "reserved": 2, "internal": 0, "external": 0, "free": 56}


def _drive(sched: Scheduler, steps: int) -> list[set[str]]:
    """Run the scheduler with fake tokens; returns the request ids scheduled per step."""
    seen = []
    for _ in range(steps):
        out = sched.schedule()
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.needs_logits:
                g = next(g for g in out.scheduled_groups if g.request_id == s.request_id)
                seq = g.seqs[0]
                seq.append_token(7)
                if seq.num_output_tokens >= g.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH
        sched.free_finished_seq_groups()
        sched.bm.check_invariants()
        seen.append({s.request_id for s in out.scheduled})
    return seen


def test_static_batching_never_joins_mid_batch() -> None:
    cfg = SchedulerConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64)
    bm = make_kv_manager("static", 64, 0, 4, max_model_len=32)
    sched = make_scheduler("static", cfg, bm)
    assert isinstance(sched, StaticBatchScheduler)
    for rid, out in (("a", 1), ("b", 4), ("c", 1)):
        sched.add_seq_group(group(4, out, rid))
    seen = _drive(sched, 6)
    assert seen[0] == {"a", "b"}
    assert all("c" not in s for s in seen[:4])  # waits for b although a finished at step 1
    assert "c" in seen[4]


def test_iteration_level_contiguous_joins_when_room() -> None:
    cfg = SchedulerConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64)
    bm = make_kv_manager("contiguous-oracle", 64, 0, 4, max_model_len=32)
    sched = make_scheduler("contiguous-oracle", cfg, bm)
    for rid, out in (("a", 1), ("b", 4), ("c", 1)):
        sched.add_seq_group(group(4, out, rid))
    seen = _drive(sched, 3)
    assert seen[0] == {"a", "b"} and "c" in seen[1]


def test_factory_rejects_unknown_and_prefix_caching() -> None:
    with pytest.raises(ValueError):
        make_kv_manager("nope", 8, 0, 4, max_model_len=32)
    with pytest.raises(ValueError):
        make_kv_manager("contiguous-max", 8, 0, 4, max_model_len=32, enable_prefix_caching=True)


@pytest.mark.parametrize("policy", KV_POLICIES)
def test_every_policy_serves_a_random_workload(policy: str) -> None:
    """All requests finish under memory pressure; baselines never preempt; invariants hold."""
    rng = random.Random(0)
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=128)
    bm = make_kv_manager(policy, 40, 0, 4, max_model_len=64)
    sched = make_scheduler(policy, cfg, bm)
    groups = [group(rng.randint(1, 30), rng.randint(1, 30), f"q{i}") for i in range(40)]
    for g in groups:
        sched.add_seq_group(g)
    steps = 0
    while sched.has_unfinished_seqs():
        _drive(sched, 1)
        steps += 1
        assert steps < 5000, "no progress"
    assert all(g.is_finished() for g in groups)
    assert all(g.seqs[0].num_output_tokens == g.max_tokens for g in groups)
    if policy != "paged":
        assert sched.num_preemptions_total == 0
    assert bm.get_num_free_gpu_blocks() == 40
