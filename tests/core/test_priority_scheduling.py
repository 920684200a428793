"""The "priority" scheduling policy (vLLM's `--scheduling-policy priority`): requests run in
(priority, arrival) order, lower first, and a queued request that cannot be placed preempts
running requests of a lower priority, never of an equal or higher one. Checked on the fake
engine of `core_sim`, whose runner verifies every attention read, against outputs computed
without any scheduler."""

import random

import pytest
from core_sim import FakeEngine, reference_output
from hypothesis import given, settings
from hypothesis import strategies as hst

from pagedjax.core import SchedulerConfig


def _queued(sched):
    return list(sched.waiting) + list(sched.swapped)


def test_policy_is_validated():
    SchedulerConfig(max_model_len=16, policy="priority")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(max_model_len=16, policy="lifo")


def test_admission_follows_priority_then_arrival():
    """One sequence slot: requests run one at a time, lowest priority value first, ties in
    arrival order; the first arrival does not start first because it came first."""
    e = FakeEngine(max_num_seqs=1, policy="priority")
    prios = {"a": 3, "b": 1, "c": 2, "d": 1, "e": 0}
    for rid, p in prios.items():
        e.add(rid, [ord(rid), 2, 3], max_tokens=3, request_priority=p)
    e.run()
    assert sorted(prios, key=lambda r: e.first_token_at[r]) == ["e", "b", "d", "c", "a"]
    for rid in prios:
        assert e.outputs_of(rid) == [reference_output([ord(rid), 2, 3], 3)]
    assert e.sched.num_preemptions_total == 0  # nothing ran that a later arrival outranked


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_higher_priority_arrival_preempts_the_lowest_running(mode):
    """Two slots held by priority-5 requests: a priority-0 arrival is scheduled at the very
    next step, in place of the latest priority-5 arrival, which resumes afterwards with its
    reference output."""
    e = FakeEngine(max_num_seqs=2, policy="priority", preemption_mode=mode)
    e.add("low1", [1, 2, 3], max_tokens=12, request_priority=5)
    e.add("low2", [4, 5, 6], max_tokens=12, request_priority=5)
    for _ in range(3):
        e.step()
    e.add("high", [7, 8, 9], max_tokens=4, request_priority=0)
    out = e.step()
    assert out.preempted == ["low2"]
    assert {s.request_id for s in out.scheduled} == {"low1", "high"}
    assert e.first_token_at["high"] == e.steps - 1  # its prompt ran, and sampled, at once
    e.run()
    assert e.finished_at["high"] < e.finished_at["low2"]
    for rid, p, n in (("low1", [1, 2, 3], 12), ("low2", [4, 5, 6], 12), ("high", [7, 8, 9], 4)):
        assert e.outputs_of(rid) == [reference_output(p, n)]
    assert e.bm.get_num_free_gpu_blocks() == 64 and e.bm.get_num_free_cpu_blocks() == 64


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_higher_priority_arrival_takes_kv_blocks_from_lower_ones(mode):
    """Slots to spare but the KV cache full of priority-1 requests: a priority-0 prompt
    needing most of the cache preempts them, lowest first, only as many as it needs, and
    runs within two steps."""
    e = FakeEngine(num_gpu_blocks=12, block_size=4, policy="priority", preemption_mode=mode,
                   max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(4):
        e.add(f"low{i}", [i + 1] * 8, max_tokens=8, request_priority=1)  # 2-3 blocks each
    for _ in range(2):
        e.step()
    assert len(e.sched.running) == 4
    big = [9] * 24  # 6 blocks, 7 with its first output
    e.add("high", big, max_tokens=2, request_priority=0)
    start = e.steps
    while "high" not in e.first_token_at:
        e.step()
    assert e.first_token_at["high"] - start <= 1
    victims = [r for out in e.outputs[start:] for r in out.preempted]
    assert victims and all(r.startswith("low") for r in victims)
    assert victims[0] == "low3"  # the latest arrival of the lowest priority goes first
    e.run()
    assert e.outputs_of("high") == [reference_output(big, 2)]
    for i in range(4):
        assert e.outputs_of(f"low{i}") == [reference_output([i + 1] * 8, 8)]
    assert e.bm.get_num_free_gpu_blocks() == 12 and e.bm.get_num_free_cpu_blocks() == 64


def test_equal_or_lower_priority_never_preempts():
    """Arrivals of the same or a lower priority (a higher value) wait for a free slot."""
    e = FakeEngine(max_num_seqs=2, policy="priority")
    e.add("a", [1, 2], max_tokens=6, request_priority=1)
    e.add("b", [3, 4], max_tokens=6, request_priority=1)
    e.step()
    e.add("same", [5, 6], max_tokens=2, request_priority=1)
    e.add("lower", [7, 8], max_tokens=2, request_priority=2)
    e.run()
    assert e.sched.num_preemptions_total == 0
    assert e.first_token_at["same"] > e.finished_at["a"] - 1
    assert e.first_token_at["lower"] >= e.first_token_at["same"]


def test_an_earlier_arrival_stamp_of_the_same_priority_does_not_preempt():
    """Arrival stamps come from the front ends' threads and may be out of order: a request
    of the same priority stamped before a running one waits for a slot; only a lower
    priority is preempted."""
    e = FakeEngine(max_num_seqs=1, policy="priority")
    e.clock = iter([10, 5])
    e.add("running", [1, 2], max_tokens=4, request_priority=1)
    e.step()
    e.add("early", [3, 4], max_tokens=2, request_priority=1)  # stamped before "running"
    e.run()
    assert e.sched.num_preemptions_total == 0
    assert e.first_token_at["early"] > e.first_token_at["running"]
    assert e.outputs_of("running") == [reference_output([1, 2], 4)]


def test_swapped_and_waiting_groups_resume_in_one_priority_order():
    """A swapped priority-2 group does not hold back a waiting priority-0 one (FCFS admits
    nothing while a group is swapped out), and it resumes before a waiting priority-3."""
    e = FakeEngine(max_num_seqs=1, policy="priority", preemption_mode="swap")
    e.add("mid", [1, 2, 3], max_tokens=8, request_priority=2)
    e.step()
    e.add("top", [4, 5], max_tokens=3, request_priority=0)
    e.add("last", [6, 7], max_tokens=3, request_priority=3)
    out = e.step()
    assert out.preempted == ["mid"] and out.blocks_to_swap_out
    assert [s.request_id for s in out.scheduled] == ["top"]
    e.run()
    order = sorted(["top", "mid", "last"], key=lambda r: e.finished_at[r])
    assert order == ["top", "mid", "last"]
    assert e.outputs_of("mid") == [reference_output([1, 2, 3], 8)]


@settings(max_examples=60, deadline=None)
@given(seed=hst.integers(0, 2**31 - 1), mode=hst.sampled_from(["recompute", "swap"]),
       chunked=hst.booleans(), caching=hst.booleans())
def test_random_arrivals_run_in_priority_order_with_their_outputs(seed, mode, chunked, caching):
    """Requests arrive at random steps with random priorities; sequence slots are what is
    short (a large cache and budget). After every step no queued request outranks a running
    one, and a request waits only while every slot is taken. Every request ends with its
    reference output and the pool is whole."""
    rng = random.Random(seed)
    slots = rng.randint(1, 4)
    e = FakeEngine(num_gpu_blocks=256, block_size=4, max_num_seqs=slots, policy="priority",
                   preemption_mode=mode, enable_chunked_prefill=chunked,
                   enable_prefix_caching=caching, max_num_batched_tokens=256)
    todo = []
    for i in range(rng.randint(3, 14)):
        prompt = [rng.randint(1, 4) for _ in range(rng.randint(1, 9))]
        todo.append((rng.randint(0, 12), f"r{i}", prompt, rng.randint(1, 6), rng.randint(0, 3)))
    todo.sort()
    sched, schedule = e.sched, e.sched.schedule

    def checked():  # as each step is scheduled, before its finished requests leave
        out = schedule()
        if _queued(sched):
            assert sum(g.max_num_running_seqs() for g in sched.running) == slots
            assert max(g.priority for g in sched.running) < \
                min(g.priority for g in _queued(sched))
        return out

    sched.schedule = checked
    added = {}
    while todo or sched.has_unfinished_seqs():
        while todo and todo[0][0] <= e.steps:
            _, rid, prompt, n, prio = todo.pop(0)
            e.add(rid, prompt, max_tokens=n, request_priority=prio)
            added[rid] = (prompt, n)
        e.step()
        assert e.steps < 2000
    for rid, (prompt, n) in added.items():
        assert e.outputs_of(rid) == [reference_output(prompt, n)], rid
    assert e.bm.get_num_free_gpu_blocks() == 256 and e.bm.get_num_free_cpu_blocks() == 64


@settings(max_examples=40, deadline=None)
@given(seed=hst.integers(0, 2**31 - 1), mode=hst.sampled_from(["recompute", "swap"]),
       n=hst.sampled_from([1, 1, 2]))
def test_random_priorities_under_memory_pressure_finish_whole(seed, mode, n):
    """A small cache and random priorities: every request ends with its reference output,
    none stalls, and the pool is whole. (``n`` = 2 reserves two sequence slots a request
    for admission and preemption to count; the fake engine samples one row a sequence.)"""
    rng = random.Random(seed)
    e = FakeEngine(num_gpu_blocks=14, block_size=4, max_num_seqs=4, policy="priority",
                   preemption_mode=mode, max_num_batched_tokens=32)
    todo = sorted((rng.randint(0, 10), f"r{i}", [rng.randint(1, 5)] * rng.randint(2, 9),
                   rng.randint(1, 8), rng.randint(0, 2)) for i in range(rng.randint(3, 10)))
    added = {}
    while todo or e.sched.has_unfinished_seqs():
        while todo and todo[0][0] <= e.steps:
            _, rid, prompt, m, prio = todo.pop(0)
            e.add(rid, prompt, max_tokens=m, n=n, request_priority=prio)
            added[rid] = (prompt, m)
        e.step()
        assert e.steps < 3000, "a request stalled"
    for rid, (prompt, m) in added.items():
        assert e.outputs_of(rid) == [reference_output(prompt, m)], rid
    assert e.bm.get_num_free_gpu_blocks() == 14 and e.bm.get_num_free_cpu_blocks() == 64
