"""Incremental detokenization: decode only a short window of new tokens each step.

Byte-level BPE tokens can split a UTF-8 character; text is released only once the window
decodes without a trailing replacement character, so streamed deltas never show half a
character and their concatenation equals decoding all tokens at once.
"""

from __future__ import annotations

import dataclasses

REPLACEMENT = "\ufffd"


@dataclasses.dataclass
class DetokState:
    text: str = ""
    prefix_offset: int = 0  # tokens before this are fully released context
    read_offset: int = 0  # tokens before this have been turned into `text`


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokState,
                             skip_special_tokens: bool) -> str:
    """Append newly decodable text to `state.text`; returns the delta."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
        delta = full[len(prefix) :]
        state.text += delta
        state.prefix_offset = state.read_offset
        state.read_offset = len(token_ids)
        return delta
    return ""


def flush(tokenizer, token_ids: list[int], state: DetokState, skip_special_tokens: bool) -> str:
    """At the end of a sequence release whatever is left (even a dangling partial char)."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    delta = full[len(prefix) :] if len(full) > len(prefix) else ""
    state.text += delta
    state.prefix_offset = state.read_offset = len(token_ids)
    return delta
