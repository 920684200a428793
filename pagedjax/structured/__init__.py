"""Structured outputs: JSON schema, regex, choice and grammar constraints on sampling.

`params` (what a request asks for, pure Python), `backend` (the interface and registry of
grammar libraries), `guidance` (llguidance, the default) and `outlines` (outlines-core),
`manager` (the engine's per-sequence matchers and the sampler's token bitmask).
"""

from pagedjax.structured.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
