"""Batched, jit-friendly token sampler.

One jitted :func:`sample` call turns the last-position logits ``[B, V]`` of a
padded decode batch into next tokens. Every per-request knob lives in a
:class:`SamplingMetadata` pytree of arrays, so mixing greedy, seeded, penalised
and filtered requests in one batch does not recompile: whether any row samples,
filters or wants top-k logprobs is data (``lax.cond`` skips the work when none
does), and the only variants are array shapes. The engine passes fixed widths
(``history_width``, ``ban_width``), and the histories and ban lists are present
together whenever any row needs either, so a batch bucket has exactly two variants.

Pipeline (matches vLLM's order)::

    raw logprobs = log_softmax(logits)               # reported logprobs
    logits -> repetition -> frequency/presence       # penalties
           -> ban (min_tokens: EOS / stop ids)
           -> greedy rows: argmax (ties -> lowest id)
           -> / temperature -> top-k -> top-p -> min-p -> categorical(row key)

Reported logprobs are the *raw* model distribution (``log_softmax`` of the
unprocessed logits), like vLLM V1's default ``raw_logprobs`` mode. They do not
depend on how a request was sampled, which makes them comparable across
requests and is what cumulative logprobs for ``best_of`` ranking use.

Randomness: each row's key is ``fold_in(key(seed), step)`` where ``step`` is
the number of tokens the sequence has generated so far, so a seeded request
reproduces its tokens whatever batch it lands in. Seed rule for ``n > 1``:
sample ``j`` of a request with seed ``s`` draws exactly the stream of a
single-sample request with seed ``s + j``, so the n samples equal n separate
requests seeded ``s .. s+n-1`` (testable, and the samples differ). Unseeded
rows use ``fold_in(fold_in(key(engine_seed), request_counter), step)``, with
sample ``j > 0`` additionally folding in ``j``. Seeds are taken modulo 2**32
(keys are derived on device from uint32 seeds).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.extend.random import threefry2x32_p

from pagedjax.chunked_top_k import chunked_top_k, exact_top_k
from pagedjax.sampling_params import _GREEDY_EPS, SamplingParams

_NEG_INF = float("-inf")
_MIN_BUCKET = 16


class SeqStateLike(Protocol):
    """What :meth:`SamplingMetadata.from_params` reads from an engine sequence."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    request_counter: int
    seq_index: int


class SeqSamplingState(NamedTuple):
    """Minimal concrete :class:`SeqStateLike` (engine sequences may duck-type it).

    ``request_counter``: engine-wide monotonically increasing request number,
    the random stream of unseeded requests. ``seq_index``: index of this
    sequence inside its request's ``n``/``best_of`` group.
    """

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    request_counter: int = 0
    seq_index: int = 0
    # Tokens sampled by a step still on the device (async scheduling): they count towards
    # `step` (the row's random stream) and `min_tokens`; the engine writes them into the
    # penalty histories on the device (`ModelRunner.merge_pending_history`).
    num_pending: int = 0


def _bucket(n: int) -> int:
    """History width bucket: 0 when unused, else a power of two >= 16."""
    if n <= 0:
        return 0
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


@struct.dataclass
class SamplingMetadata:
    """Per-row sampling parameters for a padded batch of ``B`` rows.

    Padded rows are greedy with no penalties; their outputs are garbage and
    must be ignored by the caller. Token-id arrays are padded with ``-1``.
    """

    temperature: jax.Array  # [B] f32, 0 for greedy rows
    top_k: jax.Array  # [B] i32 in [1, V]; V = disabled
    top_p: jax.Array  # [B] f32 in (0, 1]
    min_p: jax.Array  # [B] f32 in [0, 1]
    seed: jax.Array  # [B] u32 user seed (seeded rows)
    is_seeded: jax.Array  # [B] bool
    request_counter: jax.Array  # [B] u32 stream of unseeded rows
    seq_index: jax.Array  # [B] u32 index in the n/best_of group
    step: jax.Array  # [B] i32 number of tokens generated so far
    engine_seed: jax.Array  # [] u32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    # Histories as padded id lists; counts / masks are scatter-built on device,
    # so the host copies O(tokens) per penalised row, never O(V).
    output_token_ids: jax.Array  # [B, Lo] i32, Lo: 0, a fixed width, or a power-of-two bucket
    prompt_token_ids: jax.Array  # [B, Lp] i32 (repetition penalty only)
    banned_token_ids: jax.Array  # [B, S] i32, ids masked to -inf (min_tokens)
    # Structured outputs: allowed tokens as bits (bit t % 32 of word t // 32), -1 words for
    # unconstrained rows; width 0 when absent (static, by shape, like the histories).
    allowed_bitmask: jax.Array  # [B, W] i32
    # logit_bias as (id, value) lists, -1 ids padding; width 0 when absent (full variant only).
    bias_token_ids: jax.Array  # [B, Wb] i32
    bias_values: jax.Array  # [B, Wb] f32
    # Batch-wide switches, as data: flipping one never recompiles.
    all_greedy: jax.Array = True  # [] bool
    do_top_k_top_p: jax.Array = False  # [] bool
    do_min_p: jax.Array = False  # [] bool
    want_topk: jax.Array = True  # [] bool: compute the top-`num_logprobs` ids/logprobs

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy and nothing that changes the logits (penalties, bans, masks,
        biases: all absent by shape): the argmax alone decides, `sample_greedy`'s case.
        A host check on host-built metadata."""
        widths = (self.output_token_ids, self.banned_token_ids, self.allowed_bitmask,
                  self.bias_token_ids)
        return bool(self.all_greedy) and not any(a.shape[-1] for a in widths)

    @property
    def do_penalties(self) -> bool:
        """Static, by shape: penalty histories are present (width 0 when no row is penalised)."""
        return self.output_token_ids.shape[-1] > 0

    @classmethod
    def from_params(
        cls,
        rows: Sequence[tuple[SamplingParams, SeqStateLike]],
        pad_to: int,
        vocab_size: int,
        *,
        eos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        engine_seed: int = 0,
        history_width: int | None = None,
        ban_width: int | None = None,
        masks: dict[int, np.ndarray] | None = None,
        mask_width: int | None = None,
        bias_width: int | None = None,
        extra_bans: dict[int, list[int]] | None = None,
        fill: DeviceFill | None = None,
    ) -> SamplingMetadata:
        """Build the host-side (numpy) metadata for one step.

        ``rows[i]`` describes batch row ``i``; rows ``len(rows)..pad_to-1`` are
        padding. Call once per step: ``step`` and the histories come from the
        sequences' current ``output_token_ids``. ``eos_token_id`` / ``eos_token_ids`` (a model
        may have several, as Llama 3 does) are banned with the stop ids while a row is short of
        its ``min_tokens``, unless it ignores EOS. ``history_width`` / ``ban_width`` fix the
        widths of the penalty histories and ban lists when any row needs them (the engine
        passes ``max_model_len`` and the longest possible ban list, so shapes never depend
        on requests); by default they are power-of-two buckets of what this batch holds.
        ``masks`` (row -> packed allowed-token bits, structured outputs) are present at
        ``mask_width`` words whenever the histories are (default: the masks' own width); so
        are the rows' ``logit_bias`` lists, at ``bias_width``. ``extra_bans`` (row -> ids)
        join the min_tokens bans (bad words). ``fill``: see `assemble`.
        """
        b, v = pad_to, vocab_size
        if len(rows) > b:
            raise ValueError(f"pad_to={b} is smaller than the batch ({len(rows)} rows).")
        cols = {name: np.full(b, pad, dtype) for name, dtype, pad in param_columns(v)}
        temperature, top_k, top_p, min_p = (cols[k] for k in ("temperature", "top_k", "top_p",
                                                               "min_p"))
        seed, is_seeded, counter, seq_index = (cols[k] for k in ("seed", "is_seeded",
                                                                 "request_counter", "seq_index"))
        presence, frequency, repetition = (cols[k] for k in ("presence_penalty",
                                                             "frequency_penalty",
                                                             "repetition_penalty"))
        step = np.zeros(b, np.int32)
        penalised: list[int] = []
        biased: list[int] = []
        banned: dict[int, list[int]] = {}
        # Row by row, writing only what differs from the padding (as `row_params` gives it).
        for i, (p, s) in enumerate(rows):
            n_out = len(s.output_token_ids) + getattr(s, "num_pending", 0)
            step[i] = n_out
            counter[i] = s.request_counter % (1 << 32)
            if p.seed is not None:  # sample j == a lone request seeded seed + j
                seed[i] = (p.seed + s.seq_index) % (1 << 32)
                is_seeded[i] = True
            else:
                seq_index[i] = s.seq_index
            if not p.is_greedy:
                temperature[i] = p.temperature
                top_k[i] = v if p.top_k <= 0 else min(p.top_k, v)
                top_p[i] = p.top_p
                min_p[i] = p.min_p
            if p.uses_penalties:
                penalised.append(i)
                presence[i] = p.presence_penalty
                frequency[i] = p.frequency_penalty
                repetition[i] = p.repetition_penalty
            if n_out < p.min_tokens:
                banned[i] = min_tokens_bans(p, eos_token_id, eos_token_ids)
            if p.logit_bias:
                biased.append(i)
        return cls.assemble(
            rows, b, v, cols, step, penalised, biased, banned, engine_seed=engine_seed,
            history_width=history_width, ban_width=ban_width, masks=masks,
            mask_width=mask_width, bias_width=bias_width, extra_bans=extra_bans, fill=fill)

    @classmethod
    def assemble(
        cls,
        rows: Sequence[tuple[SamplingParams, SeqStateLike]],
        b: int,
        v: int,
        cols: dict[str, np.ndarray],
        step: np.ndarray,
        penalised: list[int],
        biased: list[int],
        banned: dict[int, list[int]],
        *,
        engine_seed: int = 0,
        history_width: int | None = None,
        ban_width: int | None = None,
        masks: dict[int, np.ndarray] | None = None,
        mask_width: int | None = None,
        bias_width: int | None = None,
        extra_bans: dict[int, list[int]] | None = None,
        pack_histories: bool = True,
        fill: DeviceFill | None = None,
    ) -> SamplingMetadata:
        """The metadata from per-row columns (`param_columns`, padded to ``b`` rows) and the
        rows that are penalised, biased or banned: `from_params` builds those row by row,
        `worker.sampling_batch.SamplingBatch` gathers them from rows kept across steps.
        ``pack_histories`` False (histories kept on the device, `worker.device_histories`):
        where the histories are present, the penalty history fields are None, for the
        caller to fill. ``fill`` (`DeviceFill`, single-device engines): the ban, mask and
        bias arrays are device arrays, the same cached one per shape while nothing is
        written into them."""
        blank = np.full if fill is None else fill.blank
        put = (lambda a: a) if fill is None else fill.put
        banned = {i: list(ids) for i, ids in banned.items() if ids}
        for i, ids in (extra_bans or {}).items():
            if ids:
                banned[i] = banned.get(i, []) + list(ids)
        repetition = cols["repetition_penalty"]
        # With fixed widths the histories and ban lists are all present (at those widths)
        # iff any row is penalised or banned: two variants per batch size, not eight.
        full = bool(penalised or banned or masks or biased)

        def pack(lists: dict[int, Sequence[int]], fixed: int | None, device: bool = False):
            longest = max((len(x) for x in lists.values()), default=0)
            if fixed is None:
                width = _bucket(longest)
            else:
                width = fixed if full else 0
                if longest > width:
                    raise ValueError(f"{longest} ids exceed the fixed width {width}")
            if device and not lists:
                return blank((b, width), -1, np.int32)
            out = np.full((b, width), -1, np.int32)
            for i, ids in lists.items():
                out[i, : len(ids)] = np.asarray(ids, np.int32)
            return put(out) if device else out

        if mask_width is None:
            mask_width = next((len(m) for m in (masks or {}).values()), 0)
        shape = (b, mask_width if full else 0)
        if masks:
            bitmask = np.full(shape, -1, np.int32)
            for i, m in masks.items():
                bitmask[i] = m
            bitmask = put(bitmask)
        else:
            bitmask = blank(shape, -1, np.int32)
        bias_lists = {i: list(rows[i][0].logit_bias) for i in biased}
        bias_ids = pack(bias_lists, bias_width, device=True)
        if biased:
            bias_vals = np.zeros(bias_ids.shape, np.float32)
            for i in biased:
                bias_vals[i, : len(bias_lists[i])] = list(rows[i][0].logit_bias.values())
            bias_vals = put(bias_vals)
        else:
            bias_vals = blank(bias_ids.shape, 0.0, np.float32)
        if pack_histories or not full:
            out_hist = pack({i: rows[i][1].output_token_ids for i in penalised},
                            history_width)
            prompt_hist = pack({i: rows[i][1].prompt_token_ids for i in penalised
                                if repetition[i] != 1.0}, history_width)
        else:
            out_hist = prompt_hist = None
        top_k, top_p, min_p = cols["top_k"], cols["top_p"], cols["min_p"]
        return cls(
            **cols,
            step=step,
            engine_seed=np.uint32(engine_seed % (1 << 32)),
            output_token_ids=out_hist,
            prompt_token_ids=prompt_hist,
            banned_token_ids=pack(banned, ban_width, device=True),
            allowed_bitmask=bitmask,
            bias_token_ids=bias_ids,
            bias_values=bias_vals,
            all_greedy=np.bool_(not cols["temperature"].any()),
            do_top_k_top_p=np.bool_((top_k < v).any() or (top_p < 1.0).any()),
            do_min_p=np.bool_((min_p > 0.0).any()),
            want_topk=np.bool_(True),
        )


class DeviceFill:
    """Where a single-device engine's sampling metadata puts its fixed-width id arrays.

    With any row penalised, banned, masked or biased, the ban lists, token masks and logit
    biases are all present at fixed widths (2048, vocab / 32 and 512 columns: one compiled
    variant for every such batch), so a 256-row step of sampled rows with penalties built
    ~4.5 MB of them, nearly always empty (-1 ids, zero biases), and handing numpy arrays of
    that size to the jitted sampler copied them again: 0.12 ms of fills and 0.2-0.4 ms of
    argument transfer a step on the Xeon host, against 6 us for device arrays
    (`bench/sampling_metadata.py`). An empty one is made once per shape on the device and
    reused; a written one is put on the device, so the sampler is called with device
    arrays either way (numpy and device arguments are different jit keys: mixing them
    would compile twice). The arrays are uncommitted, on the default device, as numpy
    arguments would be. The widths are fixed and the batch is a sequence bucket, so the
    cache is bounded: one set per bucket that meets such a batch, ~18 KB a row at a 49k
    vocabulary, at most ~43 MB over the 23 buckets of `max_num_seqs` 256."""

    def __init__(self) -> None:
        self._blank: dict[tuple, jax.Array] = {}

    def blank(self, shape: tuple[int, int], value, dtype) -> jax.Array:
        key = (shape, value, np.dtype(dtype).str)
        a = self._blank.get(key)
        if a is None:
            a = self._blank[key] = jax.device_put(np.full(shape, value, dtype))
        return a

    @staticmethod
    def put(a: np.ndarray) -> jax.Array:
        return jax.device_put(a)


def param_columns(vocab_size: int) -> tuple[tuple[str, type, object], ...]:
    """(field, dtype, padding value) of the metadata's per-row parameters, in `row_params`'
    order; padding rows are greedy and unpenalised."""
    return (("temperature", np.float32, 0.0), ("top_k", np.int32, vocab_size),
            ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0),
            ("seed", np.uint32, 0), ("is_seeded", np.bool_, False),
            ("request_counter", np.uint32, 0), ("seq_index", np.uint32, 0),
            ("presence_penalty", np.float32, 0.0), ("frequency_penalty", np.float32, 0.0),
            ("repetition_penalty", np.float32, 1.0))


def row_params(p: SamplingParams, s: SeqStateLike, vocab_size: int) -> tuple:
    """A row's values of `param_columns`: what its request and its index in the request fix,
    the same at every step. Greedy rows keep temperature 0 and no filters; the seed rule:
    sample j of a request seeded s draws as a lone request seeded s + j."""
    v = vocab_size
    seeded = p.seed is not None
    sampled = not p.is_greedy
    penalties = p.uses_penalties
    return (p.temperature if sampled else 0.0,
            (v if p.top_k <= 0 else min(p.top_k, v)) if sampled else v,
            p.top_p if sampled else 1.0,
            p.min_p if sampled else 0.0,
            (p.seed + s.seq_index) % (1 << 32) if seeded else 0,
            seeded,
            s.request_counter % (1 << 32),
            0 if seeded else s.seq_index,
            p.presence_penalty if penalties else 0.0,
            p.frequency_penalty if penalties else 0.0,
            p.repetition_penalty if penalties else 1.0)


def min_tokens_bans(p: SamplingParams, eos_token_id: int | None = None,
                    eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Ids banned while a row is short of its ``min_tokens``: its stop ids, and EOS unless it
    ignores EOS."""
    ids = list(p.stop_token_ids or [])
    if not p.ignore_eos:
        ids += [e for e in (eos_token_id, *eos_token_ids) if e is not None]
    return ids


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, raw logprob of the chosen token
    ranks: jax.Array  # [B] i32, 1-based rank of the chosen token under raw logprobs
    topk_logprobs: jax.Array  # [B, K] f32
    topk_ids: jax.Array  # [B, K] i32
    # [B, V] f32 raw log-softmax, left on device: beam search ranks candidates from it.
    raw_logprobs: jax.Array | None = None


class PromptLogprobs(NamedTuple):
    token_logprobs: jax.Array  # [T] f32
    ranks: jax.Array  # [T] i32
    topk_logprobs: jax.Array  # [T, K] f32
    topk_ids: jax.Array  # [T, K] i32


# --------------------------------------------------------------------------- ops


def _row_index(ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Scatter indices with -1 padding sent out of bounds (JAX wraps negatives)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return rows, jnp.where(ids < 0, vocab_size, ids)


def apply_penalties(
    logits: jax.Array,
    prompt_token_ids: jax.Array,
    output_token_ids: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
    repetition_penalty: jax.Array,
) -> jax.Array:
    """vLLM semantics: repetition over prompt+output tokens, then
    ``logit -= frequency * count + presence * (count > 0)`` over output tokens.
    """
    v = logits.shape[-1]
    rows, out_idx = _row_index(output_token_ids, v)
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, out_idx].add(1.0, mode="drop")
    rows_p, prompt_idx = _row_index(prompt_token_ids, v)
    seen = jnp.zeros(logits.shape, bool).at[rows_p, prompt_idx].set(True, mode="drop")
    seen = seen | (counts > 0)
    rep = repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    return (logits - frequency_penalty[:, None] * counts
            - presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def ban_tokens(logits: jax.Array, banned_token_ids: jax.Array) -> jax.Array:
    """Set the listed ids of each row to -inf (-1 entries are padding)."""
    rows, idx = _row_index(banned_token_ids, logits.shape[-1])
    return logits.at[rows, idx].set(_NEG_INF, mode="drop")


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set tokens whose bit is clear to -inf: token t's bit is t % 32 of word t // 32
    (llguidance's layout). Unpacked on the device: the host sends V / 32 words per row."""
    v = logits.shape[-1]
    t = jnp.arange(v, dtype=jnp.int32)
    words = bitmask[:, t >> 5]
    allowed = ((words >> (t & 31)) & 1) != 0
    return jnp.where(allowed, logits, _NEG_INF)


# Candidates from which top-k / top-p thresholds are read when they suffice (see
# `filter_logits`): enough for the nucleus of a confident distribution at common settings.
# One row whose nucleus is wider sends the whole batch to the exact search and the noise over
# the vocabulary (~80 ms at 64 x 49152 on CPU), so the count is set by real logits: the demo
# model's 64-row steps at temperature 0.8 / top-p 0.9 had nuclei of up to 48-108 tokens, and
# `sample` took 20-22 ms with 128 candidates on every step against 78-82 ms on four steps of
# six with 64; 256 gained nothing more (`bench/sampler_candidates.py`).
TOP_CANDIDATES = 128


def _radix_from_env() -> int:
    raw = os.environ.get("PAGEDJAX_SEARCH_RADIX_BITS", "2")
    if raw not in ("0", "1", "2", "4", "8"):
        raise ValueError(f"PAGEDJAX_SEARCH_RADIX_BITS: one of 0, 1, 2, 4, 8 (bits of the exact "
                         f"top-k / top-p search per pass over a row); got {raw!r}")
    return int(raw)


# Bits per pass of the exact threshold search on GPU runners (`_smallest_key`): 0 bisects.
# Compiled for H100 (deviceless, [256, 128256] rows), the top-p search's loop body is per pass
# one multi-output reduction over the row for 2 bits (3 pivots; 16 passes), two for 4 bits
# (15 pivots split 8 + 7; 8 passes), against one per bisection step (32): half the reads of
# the row either way, with 7 / 20 / 5 kernels per pass. Timed on an H200 (2026-11-30,
# `bench/sampler.py --platform gpu`, vocab 128256): flat top-p rows 2.27 / 4.64 ms at 64 / 256
# rows with 2 bits, 2.32 / 4.82 with 4, against bisection's 2.53 / 5.66; rows the candidates
# decide cost the same (the search is skipped). In the engine (Llama-3-8B shapes, sampled
# requests) the two-stage sampler's throughput rose from 1.109x to 1.161x the one-stage one's.
# Hence 2; ``PAGEDJAX_SEARCH_RADIX_BITS=0`` restores bisection.
SEARCH_RADIX_BITS = _radix_from_env()


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys that order like the float32 values (NaN excepted); an involution."""
    u = jax.lax.bitcast_convert_type(x, jnp.int32)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


def _from_order_key(k: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(k ^ ((k >> 31) & 0x7FFFFFFF), jnp.float32)


def _smallest_key(pred, rows: int, radix_bits: int = 0) -> jax.Array:
    """Per row, the smallest int32 ``m`` with ``pred(m)`` true, for ``pred`` monotone in
    ``m`` and true at int32 max.

    ``radix_bits`` 0: 32 bisection steps over the whole key range, one ``pred`` (one pass
    over the row) each. ``radix_bits`` r > 0: 32 / r steps, each testing the 2^r - 1 pivots
    that cut the interval left into 2^r equal parts. The pivots' ``pred`` calls are sibling
    reductions of the same inputs, which XLA fuses into multi-output kernels (for H100: one
    for 2 bits' 3 pivots, two for 4 bits' 15), so a GPU reads the row 16 times instead of
    32, for more compares, which a GPU has to spare and a CPU does not (CPU runners
    bisect)."""
    info = jnp.iinfo(jnp.int32)
    if radix_bits == 0:
        def step(_, c):
            lo, hi = c
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
            ok = pred(mid)
            return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

        lo = jnp.full((rows,), info.min, jnp.int32)
        hi = jnp.full((rows,), info.max, jnp.int32)
        return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]
    if 32 % radix_bits:
        raise ValueError(f"radix_bits must divide 32, got {radix_bits}")
    parts = 1 << radix_bits
    flip = jnp.uint32(0x80000000)  # uint32 offsets order like the int32 keys after this flip

    def as_key(u):
        return jax.lax.bitcast_convert_type(u ^ flip, jnp.int32)

    def radix_step(t, base):
        # The answer lies in [base, base + parts << shift): pivot j is the last key of part
        # j - 1, and the parts whose last key fails ``pred`` all lie below the answer.
        shift = (32 - radix_bits * (t + 1)).astype(jnp.uint32)
        below = jnp.zeros((rows,), jnp.uint32)
        for j in range(1, parts):
            pivot = base + ((jnp.uint32(j) << shift) - jnp.uint32(1))
            below = below + (~pred(as_key(pivot))).astype(jnp.uint32)
        return base + (below << shift)

    base = jax.lax.fori_loop(0, 32 // radix_bits, radix_step, jnp.zeros((rows,), jnp.uint32))
    return as_key(base)


def _top_k_top_p_threshold(x: jax.Array, top_k: jax.Array, top_p: jax.Array,
                           chunked: bool = False
                           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-row logit threshold of top-k then top-p, without sorting the vocabulary; also
    returns the candidates (values [B, kc] descending, and their token ids) and the value
    above which they are exact (``hidden``: -inf for `jax.lax.top_k`'s candidates; with
    ``chunked``, `chunked_top_k`'s, for GPUs, where they may miss values up to it).

    Sorting [rows, vocab] costs XLA:CPU 250 ms at 64 x 49152 (`bench/sampler.py`). The
    thresholds are values of the row: the k-th largest logit, and the smallest logit whose
    strictly larger logits hold less than `top_p` of the top-k mass (the first token past the
    nucleus is the first whose mass before it reaches `top_p`). They are read from the
    `TOP_CANDIDATES` largest logits (`lax.top_k`) where those decide them: k within the
    candidates with no tie of the k-th value past them, and the candidates holding at least
    `top_p` of the top-k mass. Rows they do not decide (a flat distribution, a large k) take
    an exact search instead: bisection over the float32 order, one pass per step, run only
    when some row needs it.

    XLA:CPU turns `lax.top_k` back into a full sort when more than one slice of its result
    feeds whole-row operations, so whole-row work here reads only `x`, its row maximum and
    the candidates reduced to one threshold (`tests/sampling` checks the compiled HLO).
    Chunked candidates decide a row only where what they need lies above ``hidden``: the
    k-th value and, for top-p, enough of the mass.
    """
    b, v = x.shape
    kc = min(TOP_CANDIDATES, v)
    radix = SEARCH_RADIX_BITS if chunked else 0  # a GPU's search (see SEARCH_RADIX_BITS)
    k = jnp.clip(top_k, 1, v)
    all_k = k >= v
    need_p = top_p < 1.0
    row_max = jnp.max(x, axis=-1)
    if chunked:
        cand, cand_ids, hidden = chunked_top_k(x, kc)
    else:
        cand, cand_ids = jax.lax.top_k(x, kc)  # [B, kc], descending
        hidden = jnp.full((b,), -jnp.inf, x.dtype)
    slot = jax.lax.broadcasted_iota(jnp.int32, cand.shape, 1)

    def pick(i):  # cand[row, i[row]] without a slice or gather of the top_k result
        return jnp.max(jnp.where(slot == i[:, None], cand, -jnp.inf), axis=-1)

    kth = jnp.where(all_k, -jnp.inf, pick(jnp.minimum(k, kc) - 1))
    # The candidates give the k-th value when every value at or above it is among them:
    # above the last candidate (a tie past it would hold top-k mass they miss) and, for
    # chunked candidates, above `hidden`.
    last = jnp.maximum(pick(jnp.full_like(k, kc - 1)), hidden)
    k_known = all_k | ((k <= kc) & ((kc == v) | (kth > last)))
    # Top-k mass: the whole row when top-k is off (one pass, only if some row has top_p < 1);
    # else the candidates hold all of it.
    full = jax.lax.cond(need_p.any(),
                        lambda: jnp.sum(jnp.exp(x - row_max[:, None]), axis=-1),
                        lambda: jnp.ones((b,), x.dtype))
    pc = jnp.where(cand >= kth[:, None], jnp.exp(cand - row_max[:, None]), 0.0)
    total = jnp.where(all_k, full, jnp.sum(pc, axis=-1))
    before = jnp.cumsum(pc, axis=-1) - pc
    n_keep = jnp.maximum(jnp.sum((cand >= kth[:, None]) & (before < top_p[:, None] * total[:, None]),
                                 axis=-1), 1)
    thr_c = jnp.where(need_p, pick(n_keep - 1), kth)
    # The cut lies among the exact candidates when those above `hidden` hold the mass.
    p_known = ~need_p | (jnp.sum(jnp.where(cand > hidden[:, None], pc, 0.0), axis=-1)
                         >= top_p * total)
    known = k_known & p_known

    def search():  # exact for every row, from `x` alone
        key = _order_key(x)
        # The k-th value by search only where the candidates do not give it (top-k is
        # usually off or small): 32 passes saved in the common case.
        kth_s = jax.lax.cond((~k_known).any(), lambda: jnp.where(k_known, kth, _from_order_key(
            _smallest_key(lambda m: jnp.sum(key > m[:, None], axis=-1) < k, b, radix))),
            lambda: kth)
        e = jnp.where(x >= kth_s[:, None], jnp.exp(x - row_max[:, None]), 0.0)
        tot = jnp.sum(e, axis=-1)
        thr = _from_order_key(_smallest_key(
            lambda m: jnp.sum(jnp.where(key > m[:, None], e, 0.0), axis=-1) < top_p * tot, b,
            radix))
        return jnp.where(need_p, thr, kth_s)  # thr >= kth_s: lower keys hold all the mass

    thr = jnp.where(known, thr_c, jax.lax.cond((~known).any(), search, lambda: thr_c))
    return thr, cand, cand_ids.astype(jnp.int32), hidden


def filter_threshold(
    logits: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    *,
    do_top_k_top_p: bool | jax.Array = True,
    do_min_p: bool | jax.Array = True,
    chunked: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The per-row logit threshold of `filter_logits` (keep ``logits >= threshold``), with
    the `TOP_CANDIDATES` largest logits, their token ids, and whether every kept token is
    among them (the threshold above the last candidate), which lets the sampler draw from
    the candidates alone. ``chunked`` (static): candidates from `chunked_top_k`, which GPUs
    compute without sorting the rows."""
    b, v = logits.shape
    kc = min(TOP_CANDIDATES, v)

    def none(x):
        return (jnp.full((b,), _NEG_INF, x.dtype), jnp.zeros((b, kc), x.dtype),
                jnp.zeros((b, kc), jnp.int32), jnp.full((b,), _NEG_INF, x.dtype))

    threshold, cand, cand_ids, hidden = jax.lax.cond(
        do_top_k_top_p, lambda x: _top_k_top_p_threshold(x, top_k, top_p, chunked), none, logits)
    row_max = jnp.max(logits, axis=-1)
    min_p_thr = jnp.where(min_p > 0, row_max + jnp.log(min_p), _NEG_INF)
    threshold = jnp.where(do_min_p, jnp.maximum(threshold, min_p_thr), threshold)
    slot = jax.lax.broadcasted_iota(jnp.int32, cand.shape, 1)
    last = jnp.max(jnp.where(slot == kc - 1, cand, _NEG_INF), axis=-1)  # not a slice: see above
    contained = do_top_k_top_p & ((kc == v) | (threshold > jnp.maximum(last, hidden)))
    return threshold, cand, cand_ids, contained


def filter_logits(
    logits: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    *,
    do_top_k_top_p: bool | jax.Array = True,
    do_min_p: bool | jax.Array = True,
    chunked: bool = False,
) -> jax.Array:
    """Mask (to -inf) tokens outside top-k, then top-p (nucleus), then min-p.

    Expects temperature-scaled logits. Each filter reduces to a per-row logit
    threshold and keeps ``logits >= threshold``, so tokens tied with the last
    kept one are all kept (deterministic, independent of sort order). Top-p
    keeps the shortest prefix of the top-k-renormalised distribution, sorted
    descending, whose mass reaches ``top_p`` (always at least one token), found
    without a sort (`_top_k_top_p_threshold`). Min-p keeps ``p >= min_p * p_max``
    which, being a ratio, is unaffected by the renormalisation of earlier filters.
    """
    threshold = filter_threshold(logits, top_k, top_p, min_p, do_top_k_top_p=do_top_k_top_p,
                                 do_min_p=do_min_p, chunked=chunked)[0]
    return jnp.where(logits >= threshold[:, None], logits, _NEG_INF)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first index of the maximum; a NaN counts as the
    maximum) as two plain reductions. XLA:CPU lowers `argmax` to a variadic (value, index)
    reduce that it does not vectorise: 8.1 ms against 1.4 ms for [64, 49152] on 2 cores
    (`bench/sampler.py`), a tenth of a 64-row decode step of the demo model."""
    nan = jnp.isnan(x)
    hit = jnp.where(nan.any(axis=-1, keepdims=True), nan,
                    x == jnp.max(x, axis=-1, keepdims=True))
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.random.categorical` for one row (the same Gumbel noise, so the same token for
    the same key) with `first_argmax`."""
    return first_argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def gumbel_at(key: jax.Array, ids: jax.Array) -> jax.Array:
    """``jax.random.gumbel(key, (V,), float32)[ids]`` for any V > max(ids), computing only
    the listed entries. With partitionable threefry (jax's default since 0.5) each entry's
    bits hash its own index, so a subset costs its size, not the vocabulary's; the float
    conversion repeats `jax.random.uniform`'s. `tests/sampling` checks equality with the
    full draw, so a change in jax shows up there."""
    k = jax.random.key_data(key)
    ids = ids.astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(k[0], k[1], jnp.zeros_like(ids), ids)
    bits = b1 ^ b2
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    u = jax.lax.max(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def gumbel_at_supported() -> bool:
    """`gumbel_at` reproduces the full draw only with partitionable threefry keys."""
    return bool(jax.config.jax_threefry_partitionable) and \
        jax.config.jax_default_prng_impl == "threefry2x32"


def row_keys(meta: SamplingMetadata) -> jax.Array:
    """Per-row PRNG keys; see the module docstring for the derivation."""

    def one(seed, seeded, counter, seq_idx, step):
        user = jax.random.key_data(jax.random.key(seed))
        engine = jax.random.key_data(
            jax.random.fold_in(jax.random.key(meta.engine_seed), counter)
        )
        base = jax.random.wrap_key_data(jnp.where(seeded, user, engine))
        k = jax.random.fold_in(base, step)
        k_seq = jax.random.fold_in(k, seq_idx)
        return jax.random.wrap_key_data(
            jnp.where(seq_idx > 0, jax.random.key_data(k_seq), jax.random.key_data(k))
        )

    return jax.vmap(one)(
        meta.seed, meta.is_seeded, meta.request_counter, meta.seq_index, meta.step
    )


def _logprob_info(
    raw_logprobs: jax.Array, token_ids: jax.Array, k: int, want_topk: jax.Array | bool = True,
    chunked: bool = False,
) -> tuple[jax.Array, ...]:
    """The chosen tokens' raw logprobs and ranks, and the top-``k`` logprobs and ids where
    ``want_topk`` (``chunked``: by `exact_top_k`, for GPUs)."""
    n = raw_logprobs.shape[0]

    def top(x):
        if chunked:
            return exact_top_k(x, k)
        top_lp, top_ids = jax.lax.top_k(x, k)
        return top_lp, top_ids.astype(jnp.int32)

    def none(x):
        return jnp.zeros((n, k), x.dtype), jnp.zeros((n, k), jnp.int32)

    top_lp, top_ids = jax.lax.cond(want_topk, top, none, raw_logprobs) if k > 0 else none(raw_logprobs)
    lp = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    rank = jnp.sum(raw_logprobs > lp[:, None], axis=-1).astype(jnp.int32) + 1
    return lp, rank, top_lp, top_ids


@functools.partial(jax.jit, static_argnames=("num_logprobs", "native", "chunked"))
def sample(logits: jax.Array, meta: SamplingMetadata, num_logprobs: int = 0,
           rows: jax.Array | None = None, native: bool = False,
           chunked: bool = False) -> SamplerOutput:
    """Sample one token per row of ``logits [B, V]`` (or of ``logits[rows]``).

    ``num_logprobs`` (static) is how many top logprobs to return per row; the engine always
    asks for ``MAX_LOGPROBS`` and turns the work off with ``meta.want_topk`` when no row
    wants them, and each request slices what it asked for. ``rows [B]`` picks (and may
    repeat) rows of ``logits``: the n samples of a fresh prompt share its one logits row.
    ``native`` (static; one CPU device): the tokens come from
    `pallas_kernels.cpu_native.sample_rows_cpu`, where each row's processing, cut and draw
    cost that row alone, instead of the batch-wide branches below (the same tokens but where
    a cut or draw is decided within float rounding), reading ``logits[rows]`` in place; the
    logprobs are its own log-sum-exp's (float rounding from XLA's), and no raw ``[B, V]``
    rows come back (`raw_logprob_rows` gives them to beams). ``chunked`` (static; GPUs, the
    runner's `chunked_top_k`): candidates and top logprobs from `chunked_top_k`, the same
    tokens and values without sorting the rows on XLA's GPU backend.
    """
    if native:  # the processing below, the cut, the draw and the logprob, row by row
        from pallas_kernels.cpu_native import sample_rows_cpu

        logits = logits.astype(jnp.float32)

        pen = meta.do_penalties
        # The kernel reads its rows of the step's logits in place: no [B, V] gather.
        tokens, lp, rank, mx, lse = sample_rows_cpu(
            logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p,
            jax.random.key_data(row_keys(meta)), _GREEDY_EPS, rows=rows,
            prompt_ids=meta.prompt_token_ids if pen else None,
            output_ids=meta.output_token_ids if pen else None,
            presence=meta.presence_penalty, frequency=meta.frequency_penalty,
            repetition=meta.repetition_penalty, bias_ids=meta.bias_token_ids,
            bias_values=meta.bias_values, banned_ids=meta.banned_token_ids,
            bitmask=meta.allowed_bitmask)
        # No [B, V] log-softmax unless a row wants top logprobs, then with the kernel's max
        # and log-sum-exp, so a top logprob is the chosen token's bits; beams take theirs
        # from `raw_logprob_rows`.
        k = num_logprobs
        b = tokens.shape[0]

        def top(_):
            x = logits if rows is None else logits[rows]
            top_lp, top_ids = jax.lax.top_k((x - mx[:, None]) - lse[:, None], k)
            return top_lp, top_ids.astype(jnp.int32)

        def none(_):
            return jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32)

        top_lp, top_ids = jax.lax.cond(meta.want_topk, top, none, 0) if k > 0 else none(0)
        return SamplerOutput(tokens, lp, rank, top_lp, top_ids, None)
    if rows is not None:
        logits = logits[rows]
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x = logits
    if meta.do_penalties:
        x = apply_penalties(x, meta.prompt_token_ids, meta.output_token_ids,
                            meta.presence_penalty, meta.frequency_penalty,
                            meta.repetition_penalty)
    if meta.bias_token_ids.shape[-1]:
        rows_b, idx = _row_index(meta.bias_token_ids, x.shape[-1])
        x = x.at[rows_b, idx].add(meta.bias_values, mode="drop")
    if meta.banned_token_ids.shape[-1]:
        x = ban_tokens(x, meta.banned_token_ids)
    if meta.allowed_bitmask.shape[-1]:
        x = apply_bitmask(x, meta.allowed_bitmask)
    keys = row_keys(meta)
    greedy_tokens = first_argmax(x).astype(jnp.int32)

    greedy = meta.temperature < _GREEDY_EPS
    b, v = x.shape
    kc = min(TOP_CANDIDATES, v)

    def scaled(x):
        return x / jnp.where(greedy, 1.0, meta.temperature)[:, None]

    def thresholds(x):
        return filter_threshold(scaled(x), meta.top_k, meta.top_p, meta.min_p,
                                do_top_k_top_p=meta.do_top_k_top_p, do_min_p=meta.do_min_p,
                                chunked=chunked)

    def no_thresholds(x):
        return (jnp.full((b,), _NEG_INF, x.dtype), jnp.zeros((b, kc), x.dtype),
                jnp.zeros((b, kc), jnp.int32), jnp.zeros((b,), bool))

    # One level of conditionals: with the whole-vocabulary draw in a conditional nested in
    # another, XLA:CPU slowed even all-greedy steps (4 -> 11 ms at 64 rows).
    thr, cand, cand_ids, contained = jax.lax.cond(meta.all_greedy, no_thresholds, thresholds, x)
    fast = jnp.all(contained | greedy) if gumbel_at_supported() else jnp.bool_(False)

    def among_candidates(x):
        # Every kept token is a candidate: Gumbel noise for the candidates only (the
        # values the full draw gives them), so the same token as the full draw.
        noisy = jnp.where(cand >= thr[:, None],
                          jax.vmap(gumbel_at)(keys, cand_ids) + cand, _NEG_INF)
        best = jnp.max(noisy, axis=-1, keepdims=True)
        return jnp.min(jnp.where(noisy == best, cand_ids, v), axis=-1).astype(jnp.int32)

    def over_vocabulary(x):  # noise for the whole vocabulary: 0.4 ms per row on 2 cores
        xs = scaled(x)
        kept = jnp.where(xs >= thr[:, None], xs, _NEG_INF)
        return jax.vmap(categorical)(keys, kept).astype(jnp.int32)

    branch = jnp.where(meta.all_greedy, 0, jnp.where(fast, 1, 2))
    sampled = jax.lax.switch(branch, [lambda x: greedy_tokens, among_candidates,
                                      over_vocabulary], x)
    tokens = jnp.where(greedy, greedy_tokens, sampled)
    return _sampler_output(raw_logprobs, tokens, num_logprobs, meta.want_topk, chunked)


def _sampler_output(raw_logprobs: jax.Array, tokens: jax.Array, num_logprobs: int,
                    want_topk: jax.Array, chunked: bool = False) -> SamplerOutput:
    lp, rank, top_lp, top_ids = _logprob_info(raw_logprobs, tokens, num_logprobs, want_topk,
                                              chunked)
    return SamplerOutput(tokens, lp, rank, top_lp, top_ids, raw_logprobs)


@jax.jit
def raw_logprob_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """``log_softmax(logits[rows])`` in float32: the raw rows beam search ranks candidates
    from, which `sample` returns itself except on its native path."""
    return jax.nn.log_softmax(logits[rows].astype(jnp.float32), axis=-1)


@jax.jit
def take_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """``logits[rows]``: the rows a sampler batch draws from, gathered in a call of its own so
    that `sample` is compiled per sampler batch size, not per (logits rows, batch) pair
    (`LLMEngine._launch`; each `sample` executable costs ~300 memory mappings on CPU,
    `worker.compile_stats.memory_maps`)."""
    return logits[rows]


@functools.cache
def _greedy_constants(b: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A greedy batch's outputs that do not depend on the logits, as read-only host arrays:
    zero logprobs, rank 1, zero top-k logprobs and ids. Returned from the host, not the
    device: each device output is one more buffer to allocate and fetch every step, and on
    the 2-core CPU host every millisecond of the engine thread is on a batched step's
    critical path (`bench/host_breakdown.py`)."""
    out = (np.zeros((b,), np.float32), np.ones((b,), np.int32),
           np.zeros((b, k), np.float32), np.zeros((b, k), np.int32))
    for a in out:
        a.setflags(write=False)
    return out


@functools.partial(jax.jit, static_argnames=("native",))
def _greedy_tokens(logits: jax.Array, rows: jax.Array, native: bool) -> tuple[jax.Array, jax.Array]:
    x = logits.astype(jnp.float32)
    if native:
        from pallas_kernels.cpu_native import greedy_rows_cpu

        tok, lp = greedy_rows_cpu(x)
    else:
        tok = first_argmax(x).astype(jnp.int32)
        top = jnp.take_along_axis(x, tok[:, None], axis=-1)
        lp = -jnp.log(jnp.sum(jnp.exp(x - top), axis=-1))
    return tok[rows], lp[rows]


def sample_greedy(logits: jax.Array, rows: jax.Array, num_logprobs: int = 0,
                  native: bool = False) -> SamplerOutput:
    """`sample` for a batch whose metadata is `plain_greedy` and wants no top logprobs: the
    same tokens, logprobs and ranks, per logits row first and then picked by ``rows``.

    `sample` gathers ``logits[rows]`` ([B, V]), writes the whole log-softmax and counts each
    row's rank over it: 43.5 ms for 256 rows of the demo model's vocabulary on a 2-core CPU,
    21.5 ms here; 4.8 vs 2.4 ms for 64 (`bench/sampler.py`, `sampler_greedy_fast.json`).
    The chosen token is the row's first maximum, so its rank is 1 and its raw logprob is
    ``-log(sum(exp(x - max)))``, what `jax.nn.log_softmax` gives it. Top-logprob outputs are
    zeros, as `sample`'s are when ``want_topk`` is off; ranks and top logprobs are host
    arrays (`_greedy_constants`), tokens and logprobs device arrays. ``native`` (one CPU
    device, the runner's `native_greedy`): the same from
    `pallas_kernels.cpu_native.greedy_rows_cpu`, which reads each row once instead of XLA's
    three passes (`bench/sampler.py` ``sample_greedy_native``)."""
    tok, lp = _greedy_tokens(logits, rows, native=native)
    _, ranks, top_lp, top_ids = _greedy_constants(rows.shape[0], num_logprobs)
    return SamplerOutput(tok, lp, ranks, top_lp, top_ids)


@jax.jit
def _greedy_hidden_tokens(hidden: jax.Array, rows: jax.Array, screen: dict,
                          panels: jax.Array) -> jax.Array:
    from pallas_kernels.cpu_native import lm_head_greedy_cpu

    return lm_head_greedy_cpu(hidden.astype(jnp.float32), screen, panels)[rows]


def sample_greedy_hidden(hidden: jax.Array, rows: jax.Array, screen: dict, panels: jax.Array,
                         num_logprobs: int = 0) -> SamplerOutput:
    """`sample_greedy`'s tokens from the final hidden states ``[R, H]`` instead of logits, for
    a batch of plain greedy rows that want no logprob at all: the native screened LM head
    (`pallas_kernels.cpu_native.lm_head_greedy_cpu`: bfloat16 scores with a proven bound,
    the few columns that could win recomputed in float32) gives exactly the first argmax of
    the float32 logits, reading half the head's bytes and never writing ``[R, V]``. No
    log-sum-exp is taken, so the logprobs are zeros: the engine uses this only for requests
    with ``logprobs=None``, whose outputs report no cumulative logprob (as vLLM V1's). Only
    the tokens are a device array (`_greedy_constants`)."""
    tok = _greedy_hidden_tokens(hidden, rows, screen, panels)
    return SamplerOutput(tok, *_greedy_constants(rows.shape[0], num_logprobs))


@functools.partial(jax.jit, static_argnames=("k", "chunked"))
def prompt_logprobs(logits: jax.Array, next_token_ids: jax.Array, k: int = 0,
                    rows: jax.Array | None = None, chunked: bool = False) -> PromptLogprobs:
    """Raw logprobs of prompt tokens: row ``t`` of ``logits [T, V]`` (or of ``logits[rows]``)
    is scored against ``next_token_ids[t]`` (i.e. prompt token ``t + 1``), plus its rank
    and the row's top-``k`` (``chunked``: as `sample`'s).
    """
    if rows is not None:
        logits = logits[rows]
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return PromptLogprobs(*_logprob_info(raw, next_token_ids.astype(jnp.int32), k,
                                         chunked=chunked))
