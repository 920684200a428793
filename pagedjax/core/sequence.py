"""Request/sequence state for the host-side scheduler.

Progress of every sequence is two integers (thesis §4.4, Table 4.1):
``num_computed_tokens`` (tokens whose KV is in the cache) and
``num_total_tokens`` (prompt + generated). The scheduler only ever moves
``num_computed_tokens``; the engine grows ``num_total_tokens`` by appending
sampled tokens.

Asynchronous scheduling (thesis §4.6.1) adds ``num_pending``: tokens sampled by a step
still running on the device. The scheduler counts them as uncomputed, so it can schedule
the next step before they are known (their ids reach the device from the sampler's output,
not from the host); the output lists hold only known tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable


class SequenceStatus(enum.Enum):
    """Lifecycle of one sequence; the FINISHED_* states are terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # rejected by the scheduler (can never fit)

    # Members are singletons: hash by identity in C, not by name in Python (`Enum.__hash__`),
    # since `status in _FINISHED` runs for every sequence several times a step.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self._value_ >= _FIRST_FINISHED  # an int compare: called per sequence per step


_FIRST_FINISHED = SequenceStatus.FINISHED_STOPPED.value
_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_IGNORED,
    }
)
# `is_finished` compares values: the FINISHED_* members must stay last in the enum.
assert all((m.value >= _FIRST_FINISHED) == (m in _FINISHED) for m in SequenceStatus)


class Sequence:
    """One token stream (a prompt plus its generated continuation)."""

    __slots__ = (
        "seq_id",
        "prompt_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "cumulative_logprob",
        "status",
        "num_pending",
        "spec_token_ids",
        "publish_at",
    )

    def __init__(self, seq_id: int, prompt_token_ids: Iterable[int]) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # The sum of its tokens' logprobs, kept where something reads it: requests that ask
        # for logprobs report it, beams and best_of rank by it. A steady step of quiet rows
        # (`Scheduler.update_steady`: none of them reports a logprob) leaves it.
        self.cumulative_logprob = 0.0
        self.status = SequenceStatus.WAITING
        self.num_pending = 0  # sampled on the device, not yet applied (async scheduling)
        self.spec_token_ids: list[int] = []  # draft tokens of the step being scheduled
        # The BlockManager's gate for `mark_blocks_computed`: fewer known computed tokens than
        # this cannot fill a block it has not published yet, so the call would do nothing
        # (0: call it). Owned by the KV manager, which resets it whenever the blocks change.
        self.publish_at = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Δ_max of thesis Alg. 1: what may be scheduled next (pending tokens included)."""
        return self.num_total_tokens + self.num_pending - self.num_computed_tokens

    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without materialising the whole list (decode hot path)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def fork(self, new_seq_id: int) -> Sequence:
        """Child for n>1 sampling / beam search; shares history, KV shared via BlockManager.fork."""
        child = Sequence(new_seq_id, self.prompt_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        return child

    def reset_for_recompute(self) -> None:
        """Preemption by recomputation (Table 4.1): forget all KV."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_total_tokens})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TokenStops:
    """A request's stops that token ids alone decide; the scheduler applies them to every
    token it appends (`Scheduler.update_from_output`). Stop strings need text: the output
    processor finds them and tells the scheduler (`Scheduler.stop_seq`)."""

    eos_ids: frozenset[int] = frozenset()  # empty when the request ignores EOS
    stop_ids: frozenset[int] = frozenset()  # the request's stop_token_ids
    min_tokens: int = 0  # EOS and stop ids end a sequence only after this many tokens
    # Both sets in one: the scheduler's test of every appended token.
    any_ids: frozenset[int] = dataclasses.field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        object.__setattr__(self, "any_ids", self.eos_ids | self.stop_ids)

    def check(self, token: int, num_output_tokens: int) -> tuple[bool, int | None]:
        """(stopped, stop reason) for `token`, the sequence's `num_output_tokens`-th output
        token: EOS (reason None) before the stop ids (reason: the id), as vLLM."""
        if num_output_tokens <= self.min_tokens:
            return _GO_ON
        if token in self.eos_ids:
            return _EOS
        if token in self.stop_ids:
            return True, token
        return _GO_ON


_GO_ON, _EOS = (False, None), (True, None)  # `TokenStops.check`'s usual answers, made once


class SequenceGroup:
    """Sequences of one request; scheduled, preempted and swapped all-or-nothing (paper §4.5).

    ``max_tokens`` feeds SRTF remaining-work estimates; ``n`` (samples or beam
    width) lets admission reserve room for the children that will be forked.
    ``cache_salt``/``model_id`` isolate prefix-cache entries between tenants or
    weights/adapters: they are part of every block hash. ``request_priority`` (lower runs
    first) orders groups under the scheduler's "priority" policy only. ``read_prefix_cache``
    False: the group computes its whole prompt, taking no prefix-cache hits (prompt logprobs
    need every position computed), while its blocks are still published for others.
    """

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        arrival_time: float,
        *,
        max_tokens: int | None = None,
        n: int = 1,
        cache_salt: str | None = None,
        model_id: str | None = None,
        stops: TokenStops | None = None,
        request_priority: int = 0,
        read_prefix_cache: bool = True,
    ) -> None:
        if not seqs:
            raise ValueError("a sequence group needs at least one sequence")
        if n < 1:
            raise ValueError("n must be >= 1")
        self.request_id = request_id
        self.seqs: list[Sequence] = list(seqs)
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        self.n = n
        self.cache_salt = cache_salt
        self.model_id = model_id
        self.stops = stops or TokenStops()
        # Output tokens that finish a sequence by length: `max_tokens`, lowered by the
        # scheduler to what `max_model_len` leaves after the prompt when it queues the group.
        self.output_limit = max_tokens if max_tokens is not None else 1 << 62
        self.request_priority = request_priority
        self.read_prefix_cache = read_prefix_cache
        # The scheduler's sort key, set when it queues the group; smaller = higher priority:
        # (arrival_time, admission counter), or (request_priority, arrival_time, counter).
        self.priority: tuple = (arrival_time, 0)

    @property
    def extra_hash_keys(self) -> tuple:
        """Mixed into block hashes so different salts/models never share KV."""
        return (self.cache_salt, self.model_id)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    # Bumped whenever any group's list of sequences changes (a fork, a dropped beam): the
    # scheduler's steady decode cohort (`core.steady_decode`) is valid only while it stands.
    seq_changes = 0

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        SequenceGroup.seq_changes += 1

    def remove(self, seq_id: int) -> None:
        self.seqs = [s for s in self.seqs if s.seq_id != seq_id]
        SequenceGroup.seq_changes += 1

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.seqs if not s.status.is_finished)

    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # fast path: asked for every request of every step
            return seqs[0].status._value_ >= _FIRST_FINISHED
        return all(s.status.is_finished for s in seqs)

    def max_num_running_seqs(self) -> int:
        """Seq slots to reserve: a lone prompt will be forked into ``n`` children."""
        if len(self.seqs) == 1:  # fast path (scheduler hot loop)
            return 0 if self.seqs[0].status.is_finished else self.n
        unfinished = self.num_unfinished
        if len(self.seqs) == 1 and unfinished == 1:
            return self.n
        return unfinished

    def num_uncomputed_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.seqs if not s.status.is_finished)

    def remaining_output_estimate(self) -> int:
        """Tokens still to generate (upper bound), used as the SRTF tie-breaker."""
        if self.max_tokens is None:
            return 0
        outs = [s.num_output_tokens for s in self.seqs if not s.status.is_finished]
        return max(0, self.max_tokens - max(outs, default=0))

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
