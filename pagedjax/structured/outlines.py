"""The outlines-core backend: JSON schemas, regexes and choices compiled ahead of time to a
token-level automaton (an `Index`: for each state, each allowed token's next state) over the
model's vocabulary, as vLLM's "outlines" backend does.

Compared with llguidance (the default): compiling costs up front (milliseconds for a small
schema, seconds to minutes for wide or deeply nested ones: a schema of any JSON object builds
a 6 900-character regex that took 16 s, so ``json_object`` is refused here), after which each
mask is a table lookup. Context-free grammars are not supported (a regex automaton cannot
count brackets), and neither are numeric bounds, ``multipleOf``, ``uniqueItems`` or property
counts, which the library's schema translation drops (`UNENFORCED`): all are refused with an
error naming the field rather than producing outputs that fail the schema.

The automaton is over token *bytes*, so the vocabulary is rebuilt from the tokenizer's token
strings: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) maps each character back to its byte;
SentencePiece-style vocabularies (Llama 2, Mistral, Gemma) spell spaces "▁" and raw bytes
``<0xNN>``. Special tokens are left out (a grammar never produces them), except the EOS id,
which the automaton allows in its final states.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

import numpy as np

from pagedjax.structured.backend import CompileCache
from pagedjax.structured.params import GuidedDecodingParams

# Tokens a matcher can roll back: speculative drafts are at most this long.
MAX_ROLLBACK = 32
# JSON whitespace between tokens: at most one space. The library's default allows any run of
# whitespace, and a small model's greedy decoding can then emit spaces until max_tokens.
WHITESPACE = r"[ ]?"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Schema keywords outlines-core's regex translation drops without a word (0.2.14, checked
# by comparing the regexes built with and without each): refused, never silently ignored.
UNENFORCED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                        "multipleOf", "uniqueItems", "minProperties", "maxProperties"})
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                        "dependentSchemas"})


def unenforced_keyword(schema, path: str = "") -> tuple[str, str] | None:
    """The first (keyword, where) of ``schema`` that outlines would not enforce."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            found = unenforced_keyword(s, f"{path}[{i}]")
            if found:
                return found
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key in UNENFORCED:
            return key, path or "the top level"
        if key in _NAME_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found = unenforced_keyword(sub, f"{where}.{name}")
                if found:
                    return found
        elif isinstance(value, dict | list):
            found = unenforced_keyword(value, where)
            if found:
                return found
    return None


def _gpt2_byte_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted (character -> byte): bytes
    that are printable Latin-1 stand for themselves, the others are shifted past 255 in
    order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each non-special token's bytes, from the tokenizer's token strings."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    out: dict[int, bytes] = {}
    if "ByteLevel" in kinds:
        chars = _gpt2_byte_chars()
        for tok, i in tokenizer.get_vocab().items():
            if i in special:
                continue
            try:
                out[i] = bytes(chars[c] for c in tok)
            except KeyError:  # an added token outside the byte alphabet: its own text
                out[i] = tok.encode()
        return out
    for tok, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        m = _BYTE_TOKEN.fullmatch(tok)
        out[i] = bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode()
    return out


class OutlinesMatcher:
    __slots__ = ("index", "g", "tokens", "eos", "_error")

    def __init__(self, index, eos: int) -> None:
        import outlines_core

        self.index = index
        self.g = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)
        self.tokens: list[int] = []  # consumed, for fork (a Guide's deepcopy copies its index)
        self.eos = eos
        self._error = ""

    def fill(self, row: np.ndarray) -> None:
        self.g.write_mask_into(row.ctypes.data, row.size, row.itemsize)

    def consume(self, token_id: int) -> bool:
        if self.index.get_next_state(self.g.get_state(), token_id) is None:
            self._error = f"token {token_id} not allowed in state {self.g.get_state()}"
            return False
        self.g.advance(token_id, return_tokens=False)
        self.tokens.append(token_id)
        return True

    def validate(self, token_ids: Sequence[int]) -> int:
        state = self.g.get_state()
        for n, t in enumerate(token_ids):
            state = self.index.get_next_state(state, t)
            if state is None:
                return n
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.g.rollback_state(num_tokens)
            del self.tokens[-num_tokens:]

    def is_stopped(self) -> bool:
        state = self.g.get_state()
        return self.index.is_final_state(state) and \
            set(self.index.get_allowed_tokens(state)) <= {self.eos}

    def fork(self) -> OutlinesMatcher:
        child = OutlinesMatcher(self.index, self.eos)
        for t in self.tokens:
            child.g.advance(t, return_tokens=False)
        child.tokens = list(self.tokens)
        return child

    def error(self) -> str:
        return self._error


class OutlinesBackend:
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import outlines_core

        self._oc = outlines_core
        self.vocab_size = vocab_size
        self.mask_width = math.ceil(vocab_size / 32)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("structured_outputs_config.backend: 'outlines' needs a tokenizer "
                             "with an EOS token")
        self.eos = int(eos)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes(tokenizer).items():
            if i != self.eos and i < vocab_size and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos, by_bytes)
        self.cache = CompileCache()

    def regex_of(self, params: GuidedDecodingParams) -> str:
        kind = params.kind
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            found = unenforced_keyword(json.loads(schema))
            if found:
                raise ValueError(f"guided_decoding.json: {found[0]!r} (at {found[1]}) is not "
                                 f"enforced by the 'outlines' structured outputs backend; use "
                                 f"backend 'guidance'")
            try:
                return self._oc.json_schema.build_regex_from_schema(schema, WHITESPACE)
            except Exception as e:  # the library raises its own error types
                raise ValueError(f"guided_decoding.json: {e}") from None
        if kind == "regex":
            return params.regex
        if kind == "choice":
            return "|".join(re.escape(c) for c in params.choice)
        raise ValueError(f"guided_decoding.{kind}: not supported by the 'outlines' structured "
                         f"outputs backend (a regex automaton); use backend 'guidance'")

    def compile(self, params: GuidedDecodingParams):
        return self.cache.get_or_compile(params.source(), lambda: self._compile(params))

    def _compile(self, params: GuidedDecodingParams):
        regex = self.regex_of(params)
        try:
            return self._oc.Index(regex, self.vocabulary)
        except Exception as e:
            raise ValueError(f"guided_decoding.{params.kind}: {e}") from None

    def matcher(self, grammar) -> OutlinesMatcher:
        return OutlinesMatcher(grammar, self.eos)

    def fill_batch(self, matchers: Sequence[OutlinesMatcher], rows: np.ndarray) -> None:
        for m, row in zip(matchers, rows, strict=True):
            m.fill(row)
