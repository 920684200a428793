"""`SpeculativeConfig`: which proposer, how many draft tokens (vLLM's field names)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (prompt lookup: continue the latest earlier occurrence of the
    sequence's last ``prompt_lookup_min..prompt_lookup_max`` tokens in its own prompt and
    output) or ``"draft_model"`` (``model``: a checkpoint or packaged model name with the
    target's vocabulary, run greedily for the drafts; ``draft_num_layers``: keep only its first
    layers, e.g. a truncated copy of the target). ``num_speculative_tokens``: most draft tokens
    per sequence and step (a step then computes up to that many + 1 tokens for the sequence
    and emits 1 to that many + 1)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {METHODS}; "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: required for method 'draft_model'")
        if self.draft_num_layers is not None and (not isinstance(self.draft_num_layers, int)
                                                  or self.draft_num_layers < 1):
            raise ValueError("speculative_config.draft_num_layers: must be an integer >= 1; "
                             f"got {self.draft_num_layers!r}")
        if not isinstance(self.num_speculative_tokens, int) or not \
                1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer in "
                             f"[1, 16]; got {self.num_speculative_tokens!r}")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise ValueError("speculative_config.prompt_lookup_min: must be an integer >= 1; "
                             f"got {self.prompt_lookup_min!r}")
        if not isinstance(self.prompt_lookup_max, int) or \
                self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("speculative_config.prompt_lookup_max: must be an integer >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min}); got "
                             f"{self.prompt_lookup_max!r}")

    @classmethod
    def coerce(cls, value: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict of its fields, or that dict as JSON (the CLI)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a dict of "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**value)
