"""KV block manager: per-sequence block tables over a GPU pool and a CPU swap pool.

Paper §4.2–4.5: logical blocks are filled left to right and mapped to
physical blocks on demand; sharing (fork, prefix cache) is by ref count with
copy-on-write on the block being written; preemption swaps whole groups to
CPU or drops them for recomputation.

Prefix caching: a full block is published under a chained key (parent entry,
its tokens, extra keys: `block_pool.block_key`) only by
:meth:`BlockManager.mark_blocks_computed`,
i.e. after the step that wrote its KV has finished, so no request can ever
hit a block whose KV is still being computed.

Sliding windows: when every layer of the model attends to at most the last
``sliding_window`` tokens, a block whose positions all lie before the window of
the next token to compute is never read again. :meth:`BlockManager.append_slots`
drops the sequence's reference to it and leaves :data:`NULL_BLOCK` in its table
slot (the kernels never read table entries before the window, so the stale id the
runner's persistent copy still holds is harmless). A freed block that was
published stays in the prefix cache until evicted: its KV is still right for any
request with that prefix. A windowed manager also allocates lazily: admission takes
only the cached blocks inside the window and the first chunk's blocks, later chunks grow the
table step by step, so a long prompt never holds more than about window + chunk tokens.

Hybrid models (global and windowed layers, Gemma 2/3) get one manager per KV-cache group
(:mod:`pagedjax.core.hybrid_kv_manager`), all sharing one :class:`BlockPool`: the functions
at the end of this module (`admission_status`, `allocate_group`, ...) take the list of
managers so that one code path admits, allocates and checks one group or several.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedjax.core import block_pool
from pagedjax.core.block_pool import ROOT_SERIAL, BlockPool
from pagedjax.core.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once memory frees up
    NEVER = enum.auto()  # larger than the whole cache: reject, never wait


@dataclass
class PrefixHandle:
    """A registered (pinned) prefix; pins only blocks whose KV has been computed."""

    handle_id: int
    token_ids: tuple[int, ...]
    extra: tuple
    num_full_blocks: int
    blocks: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # serials of the pinned blocks' entries
    valid: bool = True

    @property
    def complete(self) -> bool:
        """All full blocks of the prefix are pinned (its KV has been computed once)."""
        return self.valid and len(self.blocks) == self.num_full_blocks


# Table slot of a block released because it fell out of every layer's sliding window.
NULL_BLOCK = -1

# Table versions are unique across all block managers of the process (an engine may replace
# its KV manager), so equal versions always mean the same table.
_TABLE_VERSIONS = itertools.count()

_NEVER = 1 << 62  # `Sequence.publish_at` of a sequence that publishes nothing


class _SeqBlocks:
    """Block-manager side state of one sequence."""

    __slots__ = ("table", "on_cpu", "chain", "extra", "publish", "version", "released")

    def __init__(self, table: list[int], chain: list[int], extra: tuple,
                 version: int) -> None:
        self.table = table
        # Unique per table content up to appends: a new state, a copy-on-write replacement
        # or a swap takes a fresh number, an append keeps it. The runner's persistent batch
        # (`InputBatch`) then copies only the appended ids of a table it has seen.
        self.version = version
        self.on_cpu = False
        # Serials of the cache entries of the leading full blocks already published or found
        # (`BlockPool`: an entry is its serial).
        self.chain = chain
        self.extra = extra
        self.publish = True  # False once the prefix cache was reset under this sequence
        self.released = 0  # leading table slots already released (sliding window)

    def held(self) -> list[int]:
        return [b for b in self.table if b != NULL_BLOCK]


class BlockManager:
    """Owns all block tables; the scheduler asks it what fits and tells it what happened."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int = 0,
        max_chunk_tokens: int | None = None,
        *,
        gpu_pool: BlockPool | None = None,
        cpu_pool: BlockPool | None = None,
        cache_tag: int | None = None,
    ) -> None:
        """``max_chunk_tokens``: most tokens one step computes for a sequence (the scheduler's
        token budget); bounds what a windowed sequence ever holds (None: a whole prompt).
        ``gpu_pool``/``cpu_pool``/``cache_tag``: a KV-cache group of a hybrid model shares the
        pools with the other groups and tags its prefix-cache keys with its group index."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if num_gpu_blocks < 1:
            raise ValueError("need at least one GPU block")
        if not 0.0 <= watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if sliding_window < 0:
            raise ValueError("sliding_window must be >= 0 (0: no window)")
        self.block_size = block_size
        # Widest window when every layer is windowed (0: some layer sees everything).
        self.sliding_window = sliding_window
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Headroom kept free at admission so running decodes rarely preempt.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        if max_chunk_tokens is not None and max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        self.max_chunk_tokens = max_chunk_tokens
        self.gpu = gpu_pool or BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu = cpu_pool or BlockPool(num_cpu_blocks, enable_caching=False)
        self._tag: tuple = () if cache_tag is None else (("kv_group", cache_tag),)
        # Whether this manager keeps `Sequence.publish_at` (the scheduler's gate on
        # `mark_blocks_computed`): not a hybrid model's group, whose sibling groups publish
        # the same sequence's blocks at their own pace.
        self._gate = cache_tag is None
        self._seqs: dict[int, _SeqBlocks] = {}
        self._handles: dict[int, PrefixHandle] = {}
        self._pending_handles: set[int] = set()
        self._pinned: Counter[int] = Counter()
        self._handle_ids = itertools.count(1)
        self._versions = _TABLE_VERSIONS

    # -- helpers ----------------------------------------------------------
    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _key(self, parent: int, tokens: list[int] | tuple[int, ...], extra: tuple) -> bytes:
        """The key of a full block after the entry ``parent`` (a serial; ROOT_SERIAL: none)."""
        if self._tag:  # a hybrid model's groups hold different layers' KV for equal tokens
            extra = extra + self._tag
        return block_pool.block_key(parent, tokens, extra)

    def _lookup_prefix(self, seq: Sequence, extra: tuple) -> list[int]:
        """Longest chain of cached full blocks matching the sequence's tokens (their entries'
        serials)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        bs = self.block_size
        parent = ROOT_SERIAL
        for i in range(seq.num_total_tokens // bs):
            entry = self.gpu.lookup(self._key(parent, seq.get_token_slice(i * bs, (i + 1) * bs), extra))
            if entry is None:
                break
            hits.append(entry)
            parent = entry
        return hits

    def _cached_len(self, seq: Sequence, num_hits: int) -> int:
        # Leave at least one token to compute so the step yields logits.
        return min(num_hits * self.block_size, seq.num_total_tokens - 1)

    def _state(self, seq: Sequence) -> _SeqBlocks:
        try:
            return self._seqs[seq.seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq.seq_id} has no blocks") from None

    # -- queries ----------------------------------------------------------
    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    def is_swapped(self, seq: Sequence) -> bool:
        st = self._seqs.get(seq.seq_id)
        return st is not None and st.on_cpu

    def get_block_table(self, seq: Sequence) -> list[int]:
        return list(self._state(seq).table)

    def get_block_table_ref(self, seq: Sequence) -> tuple[list[int], int]:
        """The live table (not a copy: read it before the next call that allocates) and its
        version (see `_SeqBlocks.version`): the scheduler's per-step view, with no copy."""
        st = self._state(seq)
        return st.table, st.version

    def table_version(self, seq: Sequence) -> int:
        """The table's version (`get_block_table_ref`), or -1 for a sequence it no longer
        holds (a reader then copies whatever table it has whole)."""
        st = self._seqs.get(seq.seq_id)
        return -1 if st is None else st.version

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence references (its table less slots released by the window)."""
        st = self._state(seq)
        return len(st.table) - sum(1 for b in st.table[: st.released] if b == NULL_BLOCK)

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.get_num_free()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.get_num_free()

    def usage(self) -> float:
        """Fraction of GPU blocks referenced (evictable cached blocks count as free)."""
        return self.gpu.get_num_used() / self.num_gpu_blocks

    def get_num_cached_tokens(self, seq: Sequence, extra: tuple = (None, None)) -> int:
        """Tokens of ``seq`` an allocation now would skip thanks to the prefix cache."""
        return cached_tokens([self], seq, extra)

    # -- admission ----------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        return admission_status([self], group)

    def _seq_need(self, seq: Sequence, hits: list[int], cached: int) -> tuple[int, int]:
        """(free-list blocks an allocation consumes now: new blocks + revived cached blocks,
        blocks needed ignoring transient sharing) for one sequence given its prefix hits."""
        kept = hits
        if self.sliding_window:  # lazy: hits inside the window and the first chunk only
            dead = self._dead_blocks(cached)
            kept = hits[dead:]
            rest = seq.num_total_tokens - cached
            if self.max_chunk_tokens is not None:
                rest = min(rest, self.max_chunk_tokens)
            new = max(0, self._num_blocks(cached + rest) - len(hits))
        else:
            dead = 0
            new = self._num_blocks(seq.num_total_tokens) - len(hits)
        blocks = [self.gpu.block_of(e) for e in kept]
        revived = sum(1 for b in blocks if self.gpu.ref_count(b) == 0)
        pinned = sum(1 for b in blocks if self._pinned[b])
        need, need_never = new + revived, new + len(kept) - pinned
        if hits and self._first_write_shared(cached, hits):
            need += 1  # copy-on-write of the block the recomputed last token lands in
            need_never += 1
        return need, need_never

    def _dead_blocks(self, start: int) -> int:
        """Leading blocks no query from position ``start`` on can see (windowed only)."""
        return max(0, start - self.sliding_window + 1) // self.block_size

    @property
    def growth_capacity(self) -> int:
        """Blocks one request may ever hold: the pool less the watermark and pinned prefixes."""
        return self.num_gpu_blocks - self.watermark_blocks - len(self._pinned)

    def worst_case_blocks(self, prompt_len: int, final_len: int, num_seqs: int) -> int:
        """Blocks a request needs if all its ``num_seqs`` samples (or beams) grow to
        ``final_len`` tokens at once: they share the prompt's full blocks and each owns the
        rest (a beam that forks late shares more, never less). With prefix caching the first
        write may copy one cached block."""
        shared = prompt_len // self.block_size if num_seqs > 1 else 0
        own = self._num_blocks(final_len) - shared
        worst = shared + num_seqs * own
        if self.sliding_window:
            # A windowed sequence holds at most the window behind one chunk plus the chunk:
            # blocks from (s - W + 1) // B to (s + chunk - 1) // B of a step starting at s.
            chunk = final_len if self.max_chunk_tokens is None else min(final_len,
                                                                       self.max_chunk_tokens)
            worst = min(worst, num_seqs * (self._num_blocks(self.sliding_window - 1 + chunk) + 1))
        return worst + (1 if self.enable_prefix_caching else 0)

    def _first_write_shared(self, cached: int, hits: list) -> bool:
        """Whether the first token left to compute lands in a cached block that someone
        already references (a fully cached prompt recomputes its last token there), so that
        writing it needs a copy-on-write block."""
        idx = cached // self.block_size
        return idx < len(hits) and self.gpu.ref_count(self.gpu.block_of(hits[idx])) > 0

    def allocate(self, group: SequenceGroup) -> None:
        """Give every unfinished sequence blocks for its tokens (a windowed manager: for its
        window and first chunk), reusing cached prefixes.

        Sets ``num_computed_tokens`` to the cached length (Table 4.1).
        """
        allocate_group([self], group)

    def _take_hits(self, seq: Sequence, hits: list[int], cached: int, extra: tuple) -> None:
        """Start the sequence's table with its prefix hits (references first, so that no
        allocation, of this group or another sharing the pool, can evict a hit)."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        dead = self._dead_blocks(cached) if self.sliding_window else 0
        table = [NULL_BLOCK] * min(dead, len(hits))
        for e in hits[len(table):]:
            b = self.gpu.block_of(e)
            self.gpu.incref(b)
            table.append(b)
        st = _SeqBlocks(table, list(hits), extra, next(self._versions))
        st.released = min(dead, len(hits))
        self._seqs[seq.seq_id] = st
        seq.publish_at = 0

    def _fill(self, seq: Sequence) -> None:
        """Allocate the rest of a new table: every token (windowed: nothing, the first
        `append_slots` takes the first chunk's blocks)."""
        if self.sliding_window:
            return
        table = self._seqs[seq.seq_id].table
        for _ in range(self._num_blocks(seq.num_total_tokens) - len(table)):
            table.append(self.gpu.allocate())

    # -- growth -------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks ``append_slots(seq, num_new_tokens)`` would consume (new + CoW), net
        of the blocks it releases first behind the window."""
        st = self._state(seq)
        start = seq.num_computed_tokens
        if self.sliding_window:
            return max(0, self._gross_need(st, start, num_new_tokens)
                       - self._releasable(st, start))
        return self._gross_need(st, start, num_new_tokens)

    def _releasable(self, st: _SeqBlocks, start: int) -> int:
        """Blocks `_release_before_window` would return to the free list (sole references)."""
        dead = min(self._dead_blocks(start), len(st.table))
        ref = self.gpu.ref_count
        return sum(1 for b in st.table[st.released:dead] if b != NULL_BLOCK and ref(b) == 1)

    def _gross_need(self, st: _SeqBlocks, start: int, num_new_tokens: int) -> int:
        table = st.table
        if num_new_tokens == 1:  # decode fast path
            idx = start // self.block_size
            if idx >= len(table):
                return 1
            return 1 if self.gpu._ref[table[idx]] > 1 else 0
        end_block = self._num_blocks(start + num_new_tokens)
        need = max(0, end_block - len(table))
        ref = self.gpu.ref_count
        for i in range(start // self.block_size, min(end_block, len(table))):
            if ref(table[i]) > 1:
                need += 1
        return need

    def can_append_slots(self, group: SequenceGroup, num_tokens: int | None = None) -> bool:
        """Whether every unfinished sequence can get ``num_tokens`` (default: its Δ) slots."""
        need = 0
        for seq in group.seqs:
            if seq.status.is_finished:
                continue
            n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
            need += self.blocks_needed(seq, n)
        return need <= self.gpu.get_num_free()

    def decode_slot(self, seq: Sequence) -> tuple[list[int], int] | None:
        """Put the slot of the sequence's next token in place and return the live table and
        its version, when that is simple: the slot is already in a block the sequence alone
        holds, or it opens a block and one is free (taken, as `append_slots(seq, 1)` would
        after `blocks_needed` found it). None, having changed nothing, otherwise (a
        copy-on-write, no free block, a window to release, swapped out): the caller takes
        the general path."""
        if self.sliding_window:
            return None
        st = self._seqs.get(seq.seq_id)
        if st is None or st.on_cpu:
            return None
        table = st.table
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(table):
            return (table, st.version) if self.gpu._ref[table[idx]] == 1 else None
        if idx == len(table) and self.gpu.get_num_free() > 0:
            table.append(self.gpu.allocate())  # an append: the version stays
            return table, st.version
        return None

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Ensure slots for the next ``num_new_tokens`` tokens; returns CoW (src, dst) copies."""
        st = self._state(seq)
        if st.on_cpu:
            raise ValueError(f"sequence {seq.seq_id} is swapped out")
        table = st.table
        gpu = self.gpu
        start = seq.num_computed_tokens
        if self.sliding_window:
            self._release_before_window(st, start)
        if num_new_tokens == 1:  # decode fast path: no CoW, room in the last block
            idx = start // self.block_size
            if idx < len(table) and gpu._ref[table[idx]] == 1:
                return []
        end_block = self._num_blocks(start + num_new_tokens)
        copies: list[tuple[int, int]] = []
        for i in range(start // self.block_size, min(end_block, len(table))):
            src = table[i]
            if gpu.ref_count(src) > 1:  # shared: never write into it
                dst = gpu.allocate()
                gpu.decref(src)
                table[i] = dst
                copies.append((src, dst))
        if copies:
            st.version = next(self._versions)
        while len(table) < end_block:
            table.append(gpu.allocate())
        return copies

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` tokens' (speculative decoding: the
        slots of rejected drafts), last first. Their KV was never published (only known
        tokens' full blocks are), so nothing else changes."""
        st = self._state(seq)
        keep = max(self._num_blocks(num_tokens), st.released)
        table = st.table
        if len(table) <= keep:
            return
        pool = self.cpu if st.on_cpu else self.gpu
        while len(table) > keep:
            pool.decref(table.pop())
        st.version = next(self._versions)  # not an append: the runner rewrites its row

    def _release_before_window(self, st: _SeqBlocks, start: int) -> None:
        """Release the blocks no query from position ``start`` on can see: the first of
        them sees back to ``start - sliding_window + 1``."""
        dead = min(self._dead_blocks(start), len(st.table))
        table = st.table
        for i in range(st.released, dead):
            if table[i] != NULL_BLOCK:
                self.gpu.decref(table[i])
                table[i] = NULL_BLOCK
        st.released = max(st.released, dead)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """Child shares every block of the parent (paper §4.4 parallel sampling / beams)."""
        st = self._state(parent_seq)
        if st.on_cpu:
            raise ValueError("cannot fork a swapped-out sequence")
        if child_seq.seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq.seq_id} already has blocks")
        for b in st.held():
            self.gpu.incref(b)
        child = _SeqBlocks(list(st.table), list(st.chain), st.extra, next(self._versions))
        child.publish = st.publish
        child.released = st.released
        self._seqs[child_seq.seq_id] = child
        child_seq.publish_at = 0

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first so tail blocks are evicted first."""
        st = self._seqs.pop(seq.seq_id, None)
        seq.publish_at = 0
        if st is None:
            return
        pool = self.cpu if st.on_cpu else self.gpu
        for b in reversed(st.held()):
            pool.decref(b)

    # -- swapping -------------------------------------------------------------
    def _group_states(self, group: SequenceGroup, on_cpu: bool) -> list[_SeqBlocks]:
        out = []
        for seq in group.seqs:
            st = self._seqs.get(seq.seq_id)
            if st is not None and st.on_cpu == on_cpu and not seq.status.is_finished:
                out.append(st)
        return out

    @staticmethod
    def _distinct_blocks(states: list[_SeqBlocks]) -> int:
        return len({b for st in states for b in st.held()})

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """CPU room, and swapped blocks stay within the GPU pool size (paper §4.5 bound)."""
        return swap_out_fits([self], group)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's GPU blocks to CPU; a block shared inside the group is copied once."""
        states = self._group_states(group, on_cpu=False)
        if not swap_out_fits([self], group):
            raise RuntimeError("not enough CPU blocks to swap out")
        mapping: dict[int, int] = {}
        for st in states:
            new_table = []
            for b in st.table:
                if b == NULL_BLOCK:
                    new_table.append(b)
                    continue
                c = mapping.get(b)
                if c is None:
                    c = mapping[b] = self.cpu.allocate()
                else:
                    self.cpu.incref(c)
                new_table.append(c)
            for b in reversed(st.held()):
                self.gpu.decref(b)
            st.table = new_table
            st.version = next(self._versions)
            st.on_cpu = True
            st.chain = []  # blocks change on swap-in; republish from scratch
        for seq in group.seqs:
            seq.publish_at = 0
        return list(mapping.items())

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return self.swap_in_status(group) is AllocStatus.OK

    def swap_in_status(self, group: SequenceGroup) -> AllocStatus:
        """NEVER when the group has outgrown the whole cache and can never come back."""
        return swap_in_status([self], group)

    def _swap_in_need(self, group: SequenceGroup) -> int:
        states = self._group_states(group, on_cpu=True)
        # One spare block per sequence for the decode slot that follows.
        return self._distinct_blocks(states) + len(states)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        states = self._group_states(group, on_cpu=True)
        if self.gpu.get_num_free() < self._distinct_blocks(states):
            raise RuntimeError("not enough GPU blocks to swap in")
        mapping: dict[int, int] = {}
        for st in states:
            new_table = []
            for c in st.table:
                if c == NULL_BLOCK:
                    new_table.append(c)
                    continue
                g = mapping.get(c)
                if g is None:
                    g = mapping[c] = self.gpu.allocate()
                else:
                    self.gpu.incref(g)
                new_table.append(g)
            for c in reversed(st.held()):
                self.cpu.decref(c)
            st.table = new_table
            st.version = next(self._versions)
            st.on_cpu = False
        return list(mapping.items())

    # -- prefix cache -----------------------------------------------------------
    def mark_blocks_computed(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Publish the sequence's full blocks whose KV is now written (call after the step).

        Sets ``seq.publish_at``, the computed length below which another call would publish
        nothing (a block fills once every ``block_size`` tokens): the scheduler skips the
        call until then, and every change of the sequence's blocks here (a new table, a
        fork, a free, a swap) resets it to 0."""
        n = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        self._publish(((seq, n),))

    def publish_computed(self, pairs: Iterable[tuple[Sequence, int]]) -> None:
        """`mark_blocks_computed(seq, n)` for each (sequence, computed length) of a step, in
        order, in one call. Sequences of equal prompt lengths (`LLM.generate`'s batches, the
        benchmarks) cross block boundaries together, so one decode step in ``block_size``
        publishes a block for each of them (256 calls at 256 sequences): one call fetches
        the pool's methods once."""
        self._publish(pairs)

    def _publish(self, pairs: Iterable[tuple[Sequence, int]]) -> None:
        """The one loop behind both: tests patch it to see every publish."""
        gate = self._gate
        if not self.enable_prefix_caching:
            if gate:
                for seq, _ in pairs:
                    seq.publish_at = _NEVER
            return
        bs, seqs, key = self.block_size, self._seqs, self._key
        alive, register = self.gpu.alive, self.gpu.register
        for seq, n in pairs:
            st = seqs.get(seq.seq_id)
            if st is None or st.on_cpu:
                continue
            if not st.publish:  # the cache was reset under it: only a new table publishes
                if gate:
                    seq.publish_at = _NEVER
                continue
            chain = st.chain
            n_full = n // bs
            if len(chain) >= n_full:
                if gate:
                    seq.publish_at = (len(chain) + 1) * bs
                continue
            table = st.table
            if n_full > len(table):
                n_full = len(table)
            parent = chain[-1] if chain else ROOT_SERIAL
            extra = st.extra
            for i in range(len(chain), n_full):
                if parent != ROOT_SERIAL and not alive(parent):
                    break  # children of an evicted entry would be unreachable
                if table[i] == NULL_BLOCK:
                    break  # released by the window before it was published
                entry = register(table[i], key(parent, seq.get_token_slice(i * bs, (i + 1) * bs),
                                               extra))
                if entry is None:
                    break
                chain.append(entry)
                parent = entry
            if gate:  # a chain stuck short of the full blocks (evicted parent) leaves it low
                seq.publish_at = (len(chain) + 1) * bs
        if self._pending_handles:  # registering evicts nothing: pin once after the step's
            for hid in list(self._pending_handles):
                self._try_pin(self._handles[hid])

    def register_prefix(
        self,
        token_ids: Iterable[int],
        *,
        cache_salt: str | None = None,
        model_id: str | None = None,
    ) -> PrefixHandle:
        """Pin the full blocks of a prefix so they are never evicted.

        Only computed KV can be pinned: blocks already cached are pinned now and
        the rest as soon as a request containing the prefix computes them
        (``handle.complete`` tells). Release with :meth:`unpin`.
        """
        if not self.enable_prefix_caching:
            raise ValueError("register_prefix requires enable_prefix_caching=True")
        tokens = tuple(token_ids)
        h = PrefixHandle(
            next(self._handle_ids), tokens, (cache_salt, model_id), len(tokens) // self.block_size
        )
        self._handles[h.handle_id] = h
        self._try_pin(h)
        return h

    def _try_pin(self, h: PrefixHandle) -> None:
        bs = self.block_size
        parent = h.chain[-1] if h.chain else ROOT_SERIAL
        while len(h.blocks) < h.num_full_blocks:
            i = len(h.blocks)
            entry = self.gpu.lookup(self._key(parent, h.token_ids[i * bs : (i + 1) * bs], h.extra))
            if entry is None:
                break
            b = self.gpu.block_of(entry)
            self.gpu.incref(b)
            self._pinned[b] += 1
            h.blocks.append(b)
            h.chain.append(entry)
            parent = entry
        if h.complete:
            self._pending_handles.discard(h.handle_id)
        else:
            self._pending_handles.add(h.handle_id)

    def unpin(self, handle: PrefixHandle) -> None:
        h = self._handles.pop(handle.handle_id, None)
        self._pending_handles.discard(handle.handle_id)
        handle.valid = False
        if h is None:
            return
        for b in reversed(h.blocks):
            self._pinned[b] -= 1
            if not self._pinned[b]:
                del self._pinned[b]
            self.gpu.decref(b)
        h.blocks.clear()
        h.chain.clear()

    def reset_prefix_cache(self) -> None:
        """Forget all cached KV (e.g. new weights). Pinned prefixes are unpinned and invalidated.

        Sequences holding blocks keep them but never publish them again, since
        their KV may predate the reset; callers changing weights should also
        preempt or abort running requests.
        """
        for h in list(self._handles.values()):
            self.unpin(h)
        self.gpu.reset_cache()
        for st in self._seqs.values():
            st.chain = []
            st.publish = False

    # -- checking -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any accounting invariant is broken."""
        check_managers([self])

    def _refs(self, gpu_refs: Counter[int], cpu_refs: Counter[int]) -> None:
        """Check this manager's tables and add its references (tables, pins) to the counts."""
        for sid, st in self._seqs.items():
            held = st.held()
            assert len(set(held)) == len(held), f"seq {sid}: block listed twice"
            assert all(b == NULL_BLOCK for b in st.table[: st.released]), f"seq {sid}: window"
            assert NULL_BLOCK not in st.table[st.released :], f"seq {sid}: hole in table"
            (cpu_refs if st.on_cpu else gpu_refs).update(held)
        for h in self._handles.values():
            gpu_refs.update(h.blocks)
        assert sum(self._pinned.values()) == sum(len(h.blocks) for h in self._handles.values())


# -- one code path for one KV-cache group or several sharing a pool ----------------------
# A hybrid model's groups see the same tokens, so a request's prefix hit is the shortest hit
# over the groups (each group's hits are a chain from block 0), admission sums the groups'
# needs against the one free list, and invariants are checked over the union of references.

def common_hits(managers: list[BlockManager], seq: Sequence,
                extra: tuple) -> list[list[int]]:
    """Each group's prefix hits for ``seq``, cut to the length every group has."""
    hits = [m._lookup_prefix(seq, extra) for m in managers]
    n = min(len(h) for h in hits)
    return [h[:n] for h in hits]


def group_hits(managers: list[BlockManager], group: SequenceGroup,
               seq: Sequence) -> list[list[int]]:
    """`common_hits` for a sequence of ``group``; none for a group that does not read the
    prefix cache (`SequenceGroup.read_prefix_cache`)."""
    if not group.read_prefix_cache:
        return [[] for _ in managers]
    return common_hits(managers, seq, group.extra_hash_keys)


def cached_tokens(managers: list[BlockManager], seq: Sequence, extra: tuple) -> int:
    hits = common_hits(managers, seq, extra)
    return managers[0]._cached_len(seq, len(hits[0])) if hits[0] else 0


def _pinned_blocks(managers: list[BlockManager]) -> int:
    return sum(len(m._pinned) for m in managers)


def admission_status(managers: list[BlockManager], group: SequenceGroup) -> AllocStatus:
    """Whether ``group`` fits now (OK), once memory frees up (LATER) or never (NEVER)."""
    m0 = managers[0]
    seqs = group.get_unfinished_seqs()
    need = 0  # free-list blocks consumed (new blocks + revived cached blocks)
    need_never = 0  # blocks needed ignoring transient sharing
    for seq in seqs:
        hits = group_hits(managers, group, seq)
        cached = m0._cached_len(seq, len(hits[0])) if hits[0] else 0
        for m, h in zip(managers, hits, strict=True):
            a, b = m._seq_need(seq, h, cached)
            need += a
            need_never += b
    if len(seqs) == 1 and len(group.seqs) == 1 and group.n > 1:
        # Children forked from this prompt each copy-on-write the last block of every group.
        need += (group.n - 1) * len(managers)
        need_never += (group.n - 1) * len(managers)
    capacity = m0.num_gpu_blocks - m0.watermark_blocks - _pinned_blocks(managers)
    if need_never > capacity:
        return AllocStatus.NEVER
    if m0.gpu.get_num_free() - need >= m0.watermark_blocks:
        return AllocStatus.OK
    return AllocStatus.LATER


def allocate_group(managers: list[BlockManager], group: SequenceGroup) -> None:
    """Blocks for every unfinished sequence of ``group`` in every KV-cache group; sets
    ``num_computed_tokens`` to the prefix length cached in all groups."""
    extra = group.extra_hash_keys
    for seq in group.get_unfinished_seqs():
        if any(seq.seq_id in m._seqs for m in managers):
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        hits = group_hits(managers, group, seq)
        cached = managers[0]._cached_len(seq, len(hits[0])) if hits[0] else 0
        for m, h in zip(managers, hits, strict=True):
            m._take_hits(seq, h, cached, extra)
        for m in managers:
            m._fill(seq)
        seq.num_computed_tokens = cached


def swap_out_fits(managers: list[BlockManager], group: SequenceGroup) -> bool:
    m0 = managers[0]
    n = sum(m._distinct_blocks(m._group_states(group, on_cpu=False)) for m in managers)
    return n <= m0.cpu.get_num_free() and m0.cpu.get_num_used() + n <= m0.num_gpu_blocks


def swap_in_status(managers: list[BlockManager], group: SequenceGroup) -> AllocStatus:
    m0 = managers[0]
    need = sum(m._swap_in_need(group) for m in managers)
    if need > m0.num_gpu_blocks - m0.watermark_blocks - _pinned_blocks(managers):
        return AllocStatus.NEVER
    if m0.gpu.get_num_free() - need >= m0.watermark_blocks:
        return AllocStatus.OK
    return AllocStatus.LATER


def check_managers(managers: list[BlockManager]) -> None:
    """Every manager's tables are well formed and the shared pools' ref counts equal the
    references all managers hold."""
    gpu_refs: Counter[int] = Counter()
    cpu_refs: Counter[int] = Counter()
    for m in managers:
        m._refs(gpu_refs, cpu_refs)
    m0 = managers[0]
    m0.gpu.check_invariants(gpu_refs)
    m0.cpu.check_invariants(cpu_refs)
    assert m0.cpu.get_num_used() <= m0.num_gpu_blocks, "swapped blocks exceed GPU pool"
