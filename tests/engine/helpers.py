"""Shared by the engine tests that run one workload down two paths and compare outputs."""

from __future__ import annotations


def finished_key(out) -> tuple:
    """A finished `RequestOutput`'s completions as a comparable tuple: per completion its
    index, token ids, finish reason and top logprobs (rounded to 5 places, so the two paths'
    float noise in the last bits does not count; token choices must match exactly)."""
    return tuple(
        (c.index, tuple(c.token_ids), c.finish_reason,
         None if c.logprobs is None else tuple(
             tuple(sorted((k, round(v, 5)) for k, v in d.items())) for d in c.logprobs))
        for c in out.outputs)
