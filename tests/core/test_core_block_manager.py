import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.core import AllocStatus, BlockManager, Sequence, SequenceGroup

_ids = iter(range(10**9))


def group(prompt, n=1, rid=None, **kw) -> SequenceGroup:
    sid = next(_ids)
    return SequenceGroup(rid or f"g{sid}", [Sequence(sid, prompt)], 0.0, n=n, **kw)


def test_blocks_fill_left_to_right_and_grow_only_when_full():
    bm = BlockManager(10, 4, block_size=4)
    g = group(list(range(5)))
    seq = g.seqs[0]
    assert bm.can_allocate(g) is AllocStatus.OK
    bm.allocate(g)
    assert len(bm.get_block_table(seq)) == 2
    seq.num_computed_tokens = 5
    for tok in range(3):  # positions 5,6,7 stay in block 1
        seq.append_token(tok)
        assert bm.append_slots(seq, 1) == []
        seq.num_computed_tokens += 1
        assert len(bm.get_block_table(seq)) == 2
    seq.append_token(9)
    bm.append_slots(seq, 1)  # position 8 -> third block
    assert len(bm.get_block_table(seq)) == 3
    bm.check_invariants()
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 10
    bm.check_invariants()


def test_can_allocate_ok_later_never_and_watermark():
    bm = BlockManager(10, 0, block_size=4, watermark=0.1)  # 1 watermark block
    assert bm.can_allocate(group(list(range(40)))) is AllocStatus.NEVER
    assert bm.can_allocate(group(list(range(36)))) is AllocStatus.OK
    big = group(list(range(28)))  # 7 blocks
    bm.allocate(big)
    assert bm.can_allocate(group(list(range(8)))) is AllocStatus.OK  # 3 free - 2 >= 1
    assert bm.can_allocate(group(list(range(12)))) is AllocStatus.LATER
    # n>1 reserves one block per extra child
    assert bm.can_allocate(group(list(range(8)), n=2)) is AllocStatus.LATER


def test_fork_shares_blocks_and_cow_on_write():
    bm = BlockManager(16, 4, block_size=4)
    g = group(list(range(6)))  # 2 blocks, last one half full
    parent = g.seqs[0]
    bm.allocate(g)
    parent.num_computed_tokens = 6
    children = [parent.fork(100 + i) for i in range(2)]
    for c in children:
        bm.fork(parent, c)
    table = bm.get_block_table(parent)
    assert all(bm.get_block_table(c) == table for c in children)
    assert bm.gpu.ref_count(table[0]) == 3
    bm.check_invariants()
    copies = []
    for s in [parent, *children]:
        s.append_token(1)
        copies += bm.append_slots(s, 1)
    # two writers copy the shared last block, the last writer keeps it
    assert len(copies) == 2 and all(src == table[1] for src, _ in copies)
    assert bm.get_block_table(children[1])[1] == table[1]
    assert bm.gpu.get_num_used() == 2 + 2  # prompt blocks once + one per extra child
    bm.check_invariants()
    for s in [parent, *children]:
        bm.free(s)
    assert bm.get_num_free_gpu_blocks() == 16
    bm.check_invariants()


def test_swap_out_in_maps_shared_block_once():
    bm = BlockManager(8, 8, block_size=4)
    g = group(list(range(8)))
    p = g.seqs[0]
    bm.allocate(g)
    c = p.fork(999)
    bm.fork(p, c)
    g.add(c)
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert len(out) == 2 and bm.get_num_free_gpu_blocks() == 8
    assert bm.cpu.get_num_used() == 2 and bm.is_swapped(p)
    bm.check_invariants()
    assert bm.can_swap_in(g)
    back = bm.swap_in(g)
    assert sorted(cpu for cpu, _ in back) == sorted(cpu for _, cpu in out)
    assert bm.get_block_table(p) == bm.get_block_table(c)
    assert bm.gpu.get_num_used() == 2 and bm.cpu.get_num_used() == 0
    bm.check_invariants()


def test_swap_out_bounded_by_gpu_pool_size():
    bm = BlockManager(4, 100, block_size=2)
    g1 = group([1] * 8)
    bm.allocate(g1)
    bm.swap_out(g1)
    g2 = group([2] * 2)
    bm.allocate(g2)
    assert not bm.can_swap_out(g2)  # 4 on CPU already == whole GPU pool


def test_check_invariants_detects_corruption():
    bm = BlockManager(4, 2, block_size=2)
    g = group([1, 2, 3])
    bm.allocate(g)
    bm.check_invariants()
    bm.gpu._ref[bm.get_block_table(g.seqs[0])[0]] += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---------------------------------------------------------------------------
# Stateful fuzzing: random operations with a fake KV store that verifies that
# every sequence only ever attends to KV written for its own token prefix.
# ---------------------------------------------------------------------------

BS = 2
NUM_GPU = 12
NUM_CPU = 12


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_GPU, NUM_CPU, BS, watermark=0.0, enable_prefix_caching=True)
        self.groups: list[SequenceGroup] = []
        self.gpu_kv: dict[int, dict[int, tuple]] = {}
        self.cpu_kv: dict[int, dict[int, tuple]] = {}
        self.handles = []
        self.next_id = 0

    # helpers ---------------------------------------------------------------
    def _seqs(self, on_cpu: bool):
        return [
            (g, s)
            for g in self.groups
            for s in g.seqs
            if self.bm.has_blocks(s) and self.bm.is_swapped(s) == on_cpu
        ]

    def _check_reads(self, seq) -> None:
        toks = seq.get_token_ids()
        table = self.bm.get_block_table(seq)
        for p in range(seq.num_computed_tokens):
            got = self.gpu_kv.get(table[p // BS], {}).get(p % BS)
            assert got == tuple(toks[: p + 1]), f"seq {seq.seq_id} reads wrong KV at {p}"

    @staticmethod
    def _copy(src, dst, pairs) -> None:
        snap = {s: dict(src.get(s, {})) for s, _ in pairs}
        for s, d in pairs:
            dst[d] = snap[s]

    # rules -----------------------------------------------------------------
    @rule(
        prefix=st.sampled_from([(), (1, 2), (1, 2, 3), (1, 2, 3, 4), (5, 6, 7)]),
        tail=st.lists(st.integers(1, 3), max_size=5),
        salt=st.sampled_from([None, "a"]),
    )
    def new_group(self, prefix, tail, salt) -> None:
        prompt = list(prefix) + tail or [1]
        seq = Sequence(self.next_id, prompt)
        g = SequenceGroup(f"r{self.next_id}", [seq], 0.0, cache_salt=salt)
        self.next_id += 1
        if self.bm.can_allocate(g) is AllocStatus.OK:
            self.bm.allocate(g)
            assert seq.num_computed_tokens < seq.num_total_tokens
            assert seq.num_computed_tokens % BS == 0 or seq.num_computed_tokens == len(prompt) - 1
            self._check_reads(seq)
            self.groups.append(g)

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data(), tok=st.integers(1, 4))
    def compute(self, data, tok) -> None:
        _, seq = data.draw(st.sampled_from(self._seqs(False)))
        k = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        if self.bm.blocks_needed(seq, k) > self.bm.get_num_free_gpu_blocks():
            return
        self._copy(self.gpu_kv, self.gpu_kv, self.bm.append_slots(seq, k))
        self._check_reads(seq)
        toks = seq.get_token_ids()
        table = self.bm.get_block_table(seq)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + k):
            self.gpu_kv.setdefault(table[p // BS], {})[p % BS] = tuple(toks[: p + 1])
        seq.num_computed_tokens += k
        self.bm.mark_blocks_computed(seq, seq.num_computed_tokens)
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(tok)

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data())
    def fork(self, data) -> None:
        g, seq = data.draw(st.sampled_from(self._seqs(False)))
        child = seq.fork(self.next_id)
        self.next_id += 1
        self.bm.fork(seq, child)
        g.add(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free(self, data) -> None:
        g = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(g.seqs))
        self.bm.free(seq)
        g.remove(seq.seq_id)
        if not g.seqs:
            self.groups.remove(g)

    @precondition(lambda self: self._seqs(False))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        g, _ = data.draw(st.sampled_from(self._seqs(False)))
        if any(self.bm.is_swapped(s) for s in g.seqs):
            return  # groups are swapped as a whole
        if self.bm.can_swap_out(g):
            self._copy(self.gpu_kv, self.cpu_kv, self.bm.swap_out(g))

    @precondition(lambda self: self._seqs(True))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        g, _ = data.draw(st.sampled_from(self._seqs(True)))
        if self.bm.can_swap_in(g):
            self._copy(self.cpu_kv, self.gpu_kv, self.bm.swap_in(g))
            for s in g.seqs:
                self._check_reads(s)

    @rule(prefix=st.sampled_from([(1, 2), (1, 2, 3, 4), (5, 6, 7)]))
    def pin(self, prefix) -> None:
        self.handles.append(self.bm.register_prefix(prefix))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        h = data.draw(st.sampled_from(self.handles))
        self.handles.remove(h)
        self.bm.unpin(h)

    @rule()
    def reset_cache(self) -> None:
        self.bm.reset_prefix_cache()
        self.handles.clear()

    @invariant()
    def invariants_hold(self) -> None:
        self.bm.check_invariants()

    def teardown(self) -> None:
        for g in self.groups:
            for s in g.seqs:
                self.bm.free(s)
        for h in self.handles:
            self.bm.unpin(h)
        self.bm.check_invariants()
        assert self.bm.get_num_free_gpu_blocks() == NUM_GPU
        assert self.bm.get_num_free_cpu_blocks() == NUM_CPU


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
