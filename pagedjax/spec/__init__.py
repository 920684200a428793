"""Speculative decoding (thesis §4.4.4): proposers and the verification rule."""

from pagedjax.spec.config import SpeculativeConfig
from pagedjax.spec.ngram import NgramProposer
from pagedjax.spec.verify import accepted_prefix

__all__ = ["NgramProposer", "SpeculativeConfig", "accepted_prefix"]
