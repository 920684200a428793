"""The fixed set of array shapes the serving step runs at.

Every jitted call compiles once per argument shape, and a compile stalls every request
(seconds on CPU). So the runner pads each step to one of a small, enumerable set of shapes
and warm-up compiles exactly that set (`ShapePlan.step_shapes`); after it, serving never
compiles. A step shape is ``(T, S, M, R, decode_only)``:

- decode steps (one token per sequence): ``T = S = R`` = sequences rounded up to a sequence
  bucket: powers of two to 8 (a lone decode padded to 8 rows is 1.5x slower on CPU), then
  steps of 8 to 64, 16 to 256 and 32 beyond (`seq_bucket_list`; a decode step's cost grows
  with its rows, and power-of-two buckets made 33 sequences pay for 64: 1.7x on CPU);
- steps with prefill tokens: ``T`` = tokens rounded up to a power of two >= 16 (with
  speculative decoding, first to a lone sequence's 1 + k tokens), and ``S`` and
  ``R`` follow from ``T`` (``min(T, seq cap)``, ``R + T`` when prompt logprobs are scored),
  so mixed batches add one shape per token bucket, not one per combination;
- ``M``, the block-table width: the Pallas kernels' and the native CPU kernel's cost follows
  each sequence's real length, so with them the width is always `max_blocks_per_seq`; the
  XLA fallback path gathers the whole table, so there it takes a few widths, each 4x the last.

Sampled rows (``n`` samples of a fresh prompt share its logits row) are padded separately,
to the sampler's batch buckets (`sample_buckets`).
"""

from __future__ import annotations

import dataclasses


def pow2_at_least(n: int, minimum: int = 1) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def _pow2_range(lo: int, hi: int) -> list[int]:
    """lo, 2lo, ... up to the first power >= hi."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def seq_bucket_list(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then +8 to 64, +16 to 256, +32 beyond, up to the first >= max_num_seqs."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_num_seqs:
            return out
        b = 2 * b if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)


MIN_PREFILL_TOKENS = 16
WIDTH_STEP = 4  # XLA path: each block-table width is 4x the previous


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    fixed_width: bool  # True where attention cost follows real lengths (Pallas, native CPU)
    block_size: int = 16
    # Smallest token bucket of a step with more than one token per sequence. Speculative
    # decoding lowers it to a lone sequence's 1 + k tokens exactly: padded tokens cost full
    # compute (5 tokens padded to 16 made a batch-1 speculative step 3x the work; padded to
    # 8, 1.2x on CPU with the native matmul). The buckets after it are powers of two.
    min_tokens: int = MIN_PREFILL_TOKENS
    # Speculative decoding's k: a sequence samples up to 1 + k rows per step, so steps may
    # have more sampled rows than sequences (never more than tokens).
    spec_tokens: int = 0

    @property
    def seq_cap(self) -> int:
        return self.seq_buckets[-1]

    @property
    def seq_buckets(self) -> list[int]:
        return seq_bucket_list(self.max_num_seqs)

    @property
    def token_buckets(self) -> list[int]:
        """min_tokens, then powers of two up to the first >= max_num_batched_tokens."""
        first = pow2_at_least(self.min_tokens)
        head = [self.min_tokens] if first != self.min_tokens else []
        return head + _pow2_range(first, self.max_num_batched_tokens)

    @property
    def widths(self) -> list[int]:
        if self.fixed_width:
            return [self.max_blocks_per_seq]
        out, w = [], WIDTH_STEP
        while w < self.max_blocks_per_seq:
            out.append(w)
            w *= WIDTH_STEP
        return out + [self.max_blocks_per_seq]

    def width(self, max_blocks: int) -> int:
        if max_blocks > self.max_blocks_per_seq:
            raise ValueError(f"{max_blocks} blocks exceed max_blocks_per_seq={self.max_blocks_per_seq}")
        return next(w for w in self.widths if w >= max_blocks)

    def decode(self, num_seqs: int) -> tuple[int, int, int]:
        """(T, S, R) of a decode step."""
        s = next((b for b in self.seq_buckets if b >= num_seqs), None)
        if s is None:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs={self.max_num_seqs}")
        return s, s, s

    def mixed_seqs(self, t: int) -> int:
        """S of a step of T = t tokens: min(t, seq cap), rounded up to a sequence bucket (the
        sampler's batch sizes; only a speculative 1 + k bucket is not one already)."""
        s = min(t, self.seq_cap)
        return next(b for b in self.seq_buckets if b >= s)

    def mixed(self, num_tokens: int, num_seqs: int, extra_rows: int) -> tuple[int, int, int]:
        """(T, S, R) of a step with prefill tokens; ``extra_rows`` (prompt logprobs) <= T."""
        t = (self.min_tokens if num_tokens <= self.min_tokens
             else pow2_at_least(num_tokens, pow2_at_least(self.min_tokens)))
        s = self.mixed_seqs(t)
        if num_seqs > s or extra_rows > t:
            raise ValueError(f"step of {num_tokens} tokens has {num_seqs} sequences and "
                             f"{extra_rows} extra rows")
        return t, s, s + t if extra_rows else s

    def step_shapes(self, prompt_logprobs: bool = True) -> list[tuple[int, int, int, int, bool]]:
        """Every step shape serving can produce: what warm-up compiles."""
        shapes = []
        for m in self.widths:
            for s in self.seq_buckets:
                shapes.append((s, s, m, s, True))
            for t in self.token_buckets:
                s = self.mixed_seqs(t)
                # More than half of t tokens (the bucket's least) cannot fit in s sequences
                # of m blocks each: no step has this shape.
                if t // 2 + 1 > min(s, self.max_num_seqs) * m * self.block_size:
                    continue
                shapes.append((t, s, m, s, False))
                if self.spec_tokens and t > s:  # drafted sequences' rows exceed the sequences
                    shapes.append((t, s, m, t, False))
                if prompt_logprobs:
                    shapes.append((t, s, m, s + t, False))
        return shapes

    @property
    def sample_cap(self) -> int:
        """Most rows the sampler sees in a step: max_num_seqs (one row each, fan-outs within
        it), or with speculation up to 1 + k rows per sequence, within the token budget."""
        if not self.spec_tokens:
            return self.seq_cap
        rows = min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.spec_tokens))
        return max(self.seq_cap, pow2_at_least(rows))

    @property
    def sample_buckets(self) -> list[int]:
        """Batch sizes of the sampler: the sequence buckets, then (speculation) powers of two
        up to `sample_cap`."""
        out, b = list(self.seq_buckets), pow2_at_least(self.seq_cap + 1)
        while b <= self.sample_cap:  # `LLMEngine._sample_batch`: powers of two past seq_cap
            out.append(b)
            b *= 2
        return out

    def copy_buckets(self, num_blocks: int) -> list[int]:
        """Padded sizes of a step's copy-on-write list: at most one copy per sequence."""
        return _pow2_range(8, min(self.max_num_seqs, num_blocks))

    def logits_rows(self) -> list[int]:
        """Every distinct R (row count of the step's logits), for warming the samplers."""
        return sorted({r for _, _, _, r, _ in self.step_shapes()})
