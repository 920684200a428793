import pytest
from core_sim import FakeEngine, reference_output
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import BlockManager, Sequence, SequenceGroup, block_pool
from tests.conftest import CollidingKey

BS = 4


def first_start(e: FakeEngine, rid: str) -> int:
    """start_pos of the first step that scheduled ``rid`` == tokens served from cache."""
    for o in e.outputs:
        for s in o.scheduled:
            if s.request_id == rid:
                return s.start_pos
    raise AssertionError(f"{rid} never scheduled")


@pytest.mark.parametrize("prefix_len", range(1, 3 * BS + 2))
def test_shared_prefix_hits_full_blocks_at_every_alignment(prefix_len):
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prefix = [(7 * i) % 50 + 1 for i in range(prefix_len)]
    e.add("a", prefix + [90, 91], max_tokens=2)
    e.run()
    e.add("b", prefix + [80, 81, 82], max_tokens=2)
    e.run()
    assert first_start(e, "b") == (prefix_len // BS) * BS
    assert e.outputs_of("b") == [reference_output(prefix + [80, 81, 82], 2)]


@pytest.mark.parametrize("length", [BS, 2 * BS, 2 * BS + 1])
def test_identical_prompt_leaves_one_token_to_compute(length):
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, length + 1))
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.add("b", prompt, max_tokens=1)
    e.run()
    assert first_start(e, "b") == min((length // BS) * BS, length - 1)


def test_cow_on_shared_last_block_of_fully_cached_prompt():
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 1))
    e.add("a", prompt, max_tokens=5)
    e.step()  # a computed, its blocks published; a keeps running
    e.add("b", prompt, max_tokens=5)
    out = e.step()
    (sb,) = [s for s in out.scheduled if s.request_id == "b"]
    assert sb.start_pos == 2 * BS - 1 and sb.token_ids == [prompt[-1]]
    a_table = e.bm.get_block_table(e.groups["a"].seqs[0])
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == a_table[1]
    assert sb.block_table[0] == a_table[0] and sb.block_table[1] != a_table[1]
    e.run()
    assert e.outputs_of("b") == e.outputs_of("a") == [reference_output(prompt, 5)]


def test_blocks_not_hittable_before_computed():
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 3 * BS + 1))
    e.add("a", prompt, max_tokens=2)
    e.add("b", prompt, max_tokens=2)
    out = e.step()  # both admitted in the same step: b must not reuse a's unwritten KV
    assert [s.start_pos for s in out.scheduled] == [0, 0]
    e.run()


def test_chunked_prefill_publishes_chunks_only_after_their_step():
    e = FakeEngine(
        block_size=BS, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=3 * BS
    )
    prompt = list(range(1, 4 * BS + 1))
    e.add("a", prompt, max_tokens=1)
    e.step()  # first 3 blocks of a computed
    e.add("b", prompt, max_tokens=1)
    e.step()  # a's last chunk and b in the same step: b sees only a's first 3 blocks
    assert first_start(e, "b") == 3 * BS
    e.run()
    assert e.outputs_of("b") == [reference_output(prompt, 1)]


def test_lru_eviction_under_pressure():
    e = FakeEngine(num_gpu_blocks=8, block_size=BS, enable_prefix_caching=True)
    pa = [1] * (2 * BS)
    pb = [2] * (2 * BS)
    e.add("a", pa, max_tokens=1)
    e.run()
    e.add("b", pb, max_tokens=1)
    e.run()
    assert e.bm.gpu.num_cached_blocks() == 4
    e.add("c", list(range(100, 100 + 6 * BS)), max_tokens=1)  # needs 6 of 8 blocks
    e.step()
    e.add("b2", pb, max_tokens=1)
    e.add("a2", pa, max_tokens=1)
    e.run()
    assert first_start(e, "b2") == 2 * BS - 1  # recently used: survived
    assert first_start(e, "a2") == 0  # least recently used: evicted


def test_pinned_prefix_survives_pressure():
    e = FakeEngine(num_gpu_blocks=8, block_size=BS, enable_prefix_caching=True)
    sys_prompt = list(range(1, 2 * BS + 1))
    h = e.bm.register_prefix(sys_prompt)
    e.add("warm", sys_prompt + [50], max_tokens=1)
    e.run()
    assert h.complete and len(h.blocks) == 2
    for i in range(3):  # repeatedly use every unpinned block
        e.add(f"fill{i}", [60 + i] * (6 * BS), max_tokens=1)
        e.run()
    e.add("user", sys_prompt + [51, 52], max_tokens=2)
    e.run()
    assert first_start(e, "user") == 2 * BS
    e.bm.unpin(h)
    e.bm.check_invariants()
    assert e.bm.get_num_free_gpu_blocks() == 8


def test_cache_salt_isolates_tenants():
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 3 * BS))
    e.add("a", prompt, max_tokens=1, cache_salt="x")
    e.run()
    e.add("b", prompt, max_tokens=1, cache_salt="y")
    e.add("c", prompt, max_tokens=1, cache_salt="x")
    e.run()
    assert first_start(e, "b") == 0 and first_start(e, "c") == 2 * BS


def test_constant_hash_never_reuses_other_prompts_blocks(monkeypatch):
    monkeypatch.setattr(block_pool, "block_key", CollidingKey)
    e = FakeEngine(num_gpu_blocks=32, block_size=BS, enable_prefix_caching=True)
    base = list(range(1, 3 * BS + 1))
    variants = {
        "same": base,
        "diff_first": [99] + base[1:],
        "diff_second_block": base[:BS] + [98] + base[BS + 1 :],
        "shifted": base[1:] + [97],
    }
    e.add("orig", base, max_tokens=2)
    e.run()
    for rid, p in variants.items():
        e.add(rid, p, max_tokens=2)
        e.run()  # the fake KV checker would fail on any wrong reuse
        assert e.outputs_of(rid) == [reference_output(p, 2)]
    assert first_start(e, "same") == 3 * BS - 1
    assert first_start(e, "diff_first") == 0
    assert first_start(e, "diff_second_block") == BS
    assert first_start(e, "shifted") == 0


@pytest.mark.parametrize("colliding", [False, True])
def test_decode_blocks_published_together_are_hits(colliding, monkeypatch):
    """Equal-length sequences fill a block in the same decode step, and the scheduler
    publishes those blocks in one call (`BlockManager.publish_computed`): they must be keyed
    as a lookup keys them, under a replaced `block_key` too (``colliding``: every key hashes
    alike), so a prompt that continues one of them hits its decoded blocks and only those."""
    if colliding:
        monkeypatch.setattr(block_pool, "block_key", CollidingKey)
    e = FakeEngine(num_gpu_blocks=64, block_size=BS, enable_prefix_caching=True)
    prompts = {f"r{i}": [10 * i + j + 1 for j in range(BS + 1)] for i in range(4)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=2 * BS)
    e.run()
    assert any(len(o.publish) > 1 for o in e.outputs)  # the batched call ran
    for rid, p in prompts.items():
        e.add("c" + rid, p + e.outputs_of(rid)[0] + [99], max_tokens=1)
        e.run()
        # prompt + 2*BS outputs = 3*BS + 1 tokens, of which 2*BS + BS computed: 3 full blocks
        assert first_start(e, "c" + rid) == 3 * BS, rid
    e.bm.check_invariants()
    assert e.bm.gpu.get_num_free() == e.bm.num_gpu_blocks  # cached blocks are evictable


def test_collision_with_evicted_parent_is_a_miss(monkeypatch):
    """A child entry keyed under an evicted parent must not match a new, different parent."""
    monkeypatch.setattr(block_pool, "block_key", CollidingKey)
    bm = BlockManager(8, 0, block_size=2, enable_prefix_caching=True)

    def run(sid, tokens):
        g = SequenceGroup(f"r{sid}", [Sequence(sid, tokens)], 0.0)
        bm.allocate(g)
        seq = g.seqs[0]
        hit = seq.num_computed_tokens
        seq.num_computed_tokens = len(tokens)
        bm.mark_blocks_computed(seq, len(tokens))
        bm.free(seq)
        return hit

    assert run(1, [1, 2, 3, 4]) == 0
    a0 = bm.gpu.entry_of(0) or bm.gpu.entry_of(1)
    first = [b for b in range(8) if (k := bm.gpu.key_of(b)) and list(k.fields[1]) == [1, 2]][0]
    bm.gpu._evict(first)  # white-box: parent evicted, child [3, 4] still cached
    assert a0 is not None
    assert run(2, [5, 6, 9]) == 0  # publishes block [5, 6]
    assert run(3, [5, 6, 3, 4]) == 2  # [5, 6] hits; [3, 4] under a different parent misses
    bm.check_invariants()


def test_reset_prefix_cache_invalidates_everything():
    e = FakeEngine(block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 2))
    h = e.bm.register_prefix(prompt[: 2 * BS])
    e.add("a", prompt, max_tokens=1)
    e.run()
    assert h.complete
    e.bm.reset_prefix_cache()
    assert not h.valid and not h.complete and e.bm.gpu.num_cached_blocks() == 0
    e.bm.check_invariants()
    e.add("b", prompt, max_tokens=1)
    e.run()
    assert first_start(e, "b") == 0
    assert e.bm.get_num_free_gpu_blocks() == 64


def test_srtf_prefers_cache_hits():
    e = FakeEngine(block_size=BS, enable_prefix_caching=True, policy="srtf", max_num_batched_tokens=4 * BS)
    shared = list(range(1, 3 * BS + 1))
    e.add("warm", shared, max_tokens=1)
    e.run()
    e.add("cold", list(range(50, 50 + 3 * BS + 2)), max_tokens=1)
    e.add("hit", shared + [7], max_tokens=1)  # arrives later but has 1 token left
    out = e.step()
    assert [s.request_id for s in out.scheduled][0] == "hit"


def test_fully_cached_prompt_counts_its_copy_on_write_block_at_admission():
    """A fully cached prompt recomputes its last token in a block another request still holds,
    which costs one copy-on-write block. Admission must count it: with every free block taken
    by the running request, the newcomer waits instead of failing inside schedule()."""
    e = FakeEngine(num_gpu_blocks=3, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(1, 2 * BS + 1))
    e.add("a", prompt, max_tokens=5)
    e.step()  # a: 2 blocks, published; its next token needs the last free block
    e.add("b", prompt, max_tokens=5)
    e.run()
    assert e.outputs_of("b") == e.outputs_of("a") == [reference_output(prompt, 5)]
    assert e.bm.gpu.get_num_free() == 3  # every block back (cached blocks count as free)


def test_a_group_that_does_not_read_the_cache_computes_its_whole_prompt():
    """`read_prefix_cache=False` (prompt logprobs): the group takes no hit though its prompt is
    cached, admission counts every block it needs, its blocks are published all the same, and
    the next reader hits them. Outputs are the reference's throughout (the fake runner checks
    every attention read)."""
    e = FakeEngine(num_gpu_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.add("b", prompt, max_tokens=2, read_prefix_cache=False)
    out = e.step()
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("b", 0, 9)]
    e.run()
    e.add("c", prompt, max_tokens=2)
    out = e.step()
    assert [(s.request_id, s.start_pos) for s in out.scheduled] == [("c", 8)]
    e.run()
    for rid in "abc":
        assert e.outputs_of(rid) == [reference_output(prompt, 2)]
    assert e.bm.get_num_free_gpu_blocks() == 16


def test_publishing_blocks_leaves_nothing_for_the_collector():
    """A long decode publishes a block every `BS` tokens; the cache keeps each as bytes and an
    int (`block_pool.block_key`), so the collector's tracked objects do not grow with the
    blocks published (a key and an entry object per block did: the young collections of a
    steady decode step, and ever larger old generations), and the entries still work: a second
    sequence with the same tokens hits every block."""
    import gc

    bm = BlockManager(2048, 0, block_size=BS, enable_prefix_caching=True)
    tokens = [(37 * i) % 997 + 3 for i in range(1200 * BS)]
    seq = Sequence(1, tokens[:BS])
    bm.allocate(SequenceGroup("a", [seq], 0.0))
    seq.num_computed_tokens = BS

    def decode(n: int) -> None:
        for t in tokens[seq.num_total_tokens : seq.num_total_tokens + n]:
            seq.append_token(t)
            bm.append_slots(seq, 1)
            seq.num_computed_tokens += 1
            bm.mark_blocks_computed(seq)

    decode(100 * BS)  # lists and dicts reach a steady size first
    gc.collect()
    before = len(gc.get_objects())
    decode(1000 * BS)
    gc.collect()
    assert bm.gpu.num_cached_blocks() >= 1100
    assert len(gc.get_objects()) - before < 20  # ~3000 with objects per block
    bm.check_invariants()
    other = Sequence(2, list(seq.prompt_token_ids) + list(seq.output_token_ids))
    bm.allocate(SequenceGroup("b", [other], 0.0))
    assert other.num_computed_tokens == (other.num_total_tokens // BS) * BS - (
        1 if other.num_total_tokens % BS == 0 else 0)
    bm.free(seq)
    bm.free(other)
    bm.check_invariants()


_EXTRA = st.tuples(st.one_of(st.none(), st.text(max_size=6)),
                   st.one_of(st.none(), st.text(max_size=6)))


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(st.integers(0, 2**40), st.lists(st.integers(0, 2**31), max_size=6), _EXTRA),
       b=st.tuples(st.integers(0, 2**40), st.lists(st.integers(0, 2**31), max_size=6), _EXTRA))
def test_block_keys_are_equal_exactly_when_their_contents_are(a, b):
    """`block_key` packs (parent serial, tokens, extra keys) into bytes: the cache's dict then
    tells blocks apart by content, whatever the token counts and salts."""
    ka, kb = block_pool.block_key(*a), block_pool.block_key(*b)
    assert (ka == kb) == (a == b)
    assert block_pool.block_key(a[0], tuple(a[1]), a[2]) == ka  # list or tuple of tokens alike
