"""Beam search: on-device candidate selection + host-side bookkeeping.

Per decode step the engine gathers the logits of every live beam of every
beam-search request into ``[G, W, V]`` (``G`` groups, padded to width ``W``;
``live`` marks real beams) and calls :func:`beam_candidates`, which returns the
top ``2W`` (parent beam, token, cumulative logprob) triples per group from the
flattened ``W * V`` space with one ``lax.top_k``; nothing loops over the
vocabulary on the host. ``2W`` candidates guarantee ``W`` non-EOS continuations
even if up to ``W`` of them end in EOS.

The host then runs :func:`split_candidates` (which candidates finish, which
survive; the engine forks the parent's blocks copy-on-write for each survivor
and frees parents that got none) and :func:`should_stop`.

On the first step all ``W`` slots would hold the same prompt, so the engine
must mark only one beam live there, or identical candidates fill the beam.

Scores: ``cum_logprob / seq_len ** length_penalty`` (HF / vLLM definition).
Following vLLM, ``seq_len`` is the full sequence length (prompt + output)
excluding a trailing EOS token.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class BeamCandidates(NamedTuple):
    parent: jax.Array  # [G, C] i32 index of the parent beam in the group
    token_ids: jax.Array  # [G, C] i32
    cum_logprobs: jax.Array  # [G, C] f32, parent cum + log p(token); -inf = invalid
    valid: jax.Array  # [G, C] bool


class BeamCandidate(NamedTuple):
    parent: int
    token_id: int
    cum_logprob: float


@functools.partial(jax.jit, static_argnames=("num_candidates", "normalized"))
def beam_candidates(
    logits: jax.Array,
    cum_logprobs: jax.Array,
    live: jax.Array,
    num_candidates: int | None = None,
    normalized: bool = False,
) -> BeamCandidates:
    """Top candidates per group from ``logits [G, W, V]``.

    ``cum_logprobs [G, W]`` are the beams' cumulative logprobs, ``live [G, W]``
    masks padded beams. Returns ``num_candidates`` (default ``2W``) candidates
    per group sorted by descending cumulative logprob; ties resolve to the
    lower flat index (lower parent, then lower token). Groups with too few live
    candidates are padded with ``valid=False`` rows. ``normalized``: ``logits`` are already
    log-probabilities (the sampler's raw log-softmax).
    """
    g, w, v = logits.shape
    c = 2 * w if num_candidates is None else num_candidates
    logp = logits.astype(jnp.float32) if normalized else jax.nn.log_softmax(
        logits.astype(jnp.float32), axis=-1)
    scores = jnp.where(live[..., None], logp + cum_logprobs[..., None], -jnp.inf)
    top, idx = jax.lax.top_k(scores.reshape(g, w * v), c)
    idx = idx.astype(jnp.int32)
    return BeamCandidates(idx // v, idx % v, top, top > -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_candidates",))
def beam_candidates_from_rows(logprobs: jax.Array, rows: jax.Array, cum_logprobs: jax.Array,
                              live: jax.Array, num_candidates: int) -> BeamCandidates:
    """`beam_candidates` over ``logprobs[rows]``: ``logprobs [B, V]`` are the sampler's raw
    log-softmax rows, ``rows [G, W]`` the row of each group's beam (padding masked by
    ``live``). One jitted call, so the gather never compiles on its own."""
    return beam_candidates(logprobs[rows], cum_logprobs, live, num_candidates, normalized=True)


def beam_candidates_numpy(logprobs: np.ndarray, cum_logprobs: np.ndarray,
                          num_candidates: int) -> BeamCandidates:
    """Host version for one group ``logprobs [W, V]`` (all live), same order and tie rule:
    used when a group's beams were computed in different steps (a rare token-budget split)."""
    w, v = logprobs.shape
    scores = (logprobs.astype(np.float32) + np.asarray(cum_logprobs, np.float32)[:, None]).ravel()
    order = np.argsort(-scores, kind="stable")[:num_candidates]
    top = scores[order]
    pad = num_candidates - len(order)
    if pad > 0:
        order = np.concatenate([order, np.zeros(pad, order.dtype)])
        top = np.concatenate([top, np.full(pad, -np.inf, np.float32)])
    return BeamCandidates((order // v)[None].astype(np.int32), (order % v)[None].astype(np.int32),
                          top[None], (top > -np.inf)[None])


def length_penalized_score(cum_logprob: float, seq_len: int, length_penalty: float = 1.0) -> float:
    """HF/vLLM beam score: ``cum_logprob / seq_len ** length_penalty``."""
    return cum_logprob / (seq_len**length_penalty)


def split_candidates(
    parents: Sequence[int] | np.ndarray,
    token_ids: Sequence[int] | np.ndarray,
    cum_logprobs: Sequence[float] | np.ndarray,
    beam_width: int,
    eos_token_ids: Collection[int],
    valid: Sequence[bool] | np.ndarray | None = None,
) -> tuple[list[BeamCandidate], list[BeamCandidate]]:
    """Split one group's sorted candidates into (next live beams, newly finished).

    Walks candidates best-first: an EOS candidate finishes a hypothesis only if
    it ranks within the top ``beam_width`` (as in HF, a worse-ranked EOS would
    displace better continuations); other candidates become live beams until
    ``beam_width`` are collected.
    """
    live: list[BeamCandidate] = []
    finished: list[BeamCandidate] = []
    for rank, (p, t, s) in enumerate(zip(parents, token_ids, cum_logprobs, strict=True)):
        if (valid is not None and not valid[rank]) or not np.isfinite(s):
            continue
        cand = BeamCandidate(int(p), int(t), float(s))
        if int(t) in eos_token_ids:
            if rank < beam_width:
                finished.append(cand)
        elif len(live) < beam_width:
            live.append(cand)
        if len(live) == beam_width:  # later EOS ranks are >= beam_width
            break
    return live, finished


def should_stop(
    finished_scores: Sequence[float],
    best_live_cum_logprob: float,
    best_live_seq_len: int,
    beam_width: int,
    length_penalty: float,
    early_stopping: bool | Literal["never"],
    max_seq_len: int,
) -> bool:
    """Whether a beam group is done, given ``beam_width`` finished hypotheses.

    ``finished_scores`` are length-penalised scores of the finished beams kept
    so far. Fewer than ``beam_width`` finished: never stop (the caller still
    stops at ``max_tokens``). ``early_stopping=True`` stops right away;
    ``False`` stops when the best live beam, scored at its current length,
    cannot beat the worst kept finished one (cheap heuristic: more tokens only
    lower cum_logprob); ``"never"`` assumes the live beam may grow to
    ``max_seq_len`` which, for ``length_penalty > 0``, is its best attainable
    score (the canonical, exact rule).
    """
    if len(finished_scores) < beam_width:
        return False
    if early_stopping is True:
        return True
    worst_finished = min(sorted(finished_scores, reverse=True)[:beam_width])
    if early_stopping == "never" and length_penalty > 0.0:
        best_possible = length_penalized_score(best_live_cum_logprob, max_seq_len, length_penalty)
    else:
        best_possible = length_penalized_score(
            best_live_cum_logprob, best_live_seq_len, length_penalty
        )
    return worst_finished >= best_possible
