"""Verification of draft tokens: how many to accept.

The target model scores a sequence's last known token and its ``k`` drafts in one step, and
the sampler draws one token ``x_j`` from the target distribution at each of the ``k + 1``
positions, each row with the key and penalty history it would have without speculation
(row j counts the j drafts before it as outputs). The drafts are accepted while
``x_j == d_j``; the sequence then gains ``x_0 .. x_a`` (the accepted drafts and the target's own
token at the first mismatch, or a bonus token after ``k`` accepted drafts).

This is exact for proposers whose drafts are deterministic given the context (n-gram lookup,
a greedy draft model): for a point-mass proposal ``q = δ(d)`` the standard rule accepts ``d``
with probability ``min(1, p(d) / q(d)) = p(d)`` — the probability that ``x ~ p`` equals ``d`` —
and on rejection draws from ``(p - q)+`` normalised, i.e. ``p`` conditioned on ``x != d`` —
the distribution of ``x`` given ``x != d``. So every emitted token has exactly the target's
distribution, and greedy decoding (``x_j`` the argmax) is unchanged token for token. With
per-request seeds the keys are those of the unspeculated positions, so seeded outputs are
identical with and without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Number of leading drafts equal to the target's tokens at their positions
    (``len(sampled) == len(drafts) + 1``)."""
    a = 0
    for d, x in zip(drafts, sampled):
        if d != x:
            break
        a += 1
    return a
