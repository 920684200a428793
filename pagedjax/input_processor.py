"""Input processing: everything about a new request that needs no engine state.

Checks come before any expensive work (a prompt's size before tokenizing it, which took
seconds for 10 MB of text), each failure a `ValueError` whose message starts with the bad
field's name (the front doors map it to 400 / INVALID_ARGUMENT). Admission control for growth
(`check_growth`) bounds a request by the whole KV cache, not by what is free now: the
scheduler's preemption takes care of the latter.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.sampling_params import SamplingParams

MAX_REQUEST_ID_CHARS = 256
MAX_CHARS_PER_TOKEN = 64
OUTPUT_KINDS = ("cumulative", "delta", "final_only", "delta_ids")


@dataclasses.dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    num_samples: int  # n, or best_of (beams: the beam width)


def text_free_ok(params: SamplingParams) -> bool:
    """Whether a request may stream outputs without text (output_kind "delta_ids"): nothing
    in the engine then reads its text (no stop strings; beam search decodes its hypotheses
    itself). best_of > n may: its one output, at the end, holds the chosen samples' ids."""
    return not (params.has_stop_strings or params.use_beam_search)


PRIORITY_RANGE = (-(2**63), 2**63 - 1)  # an int64, as a protobuf field would carry it


def check_priority(priority, policy: str) -> None:
    """A request's `priority`: an integer, and non-zero only under the "priority" policy (as
    vLLM, which refuses a priority the scheduler would silently ignore)."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise ValueError(f"priority: must be an integer; got {type(priority).__name__}")
    lo, hi = PRIORITY_RANGE
    if not lo <= priority <= hi:
        raise ValueError(f"priority: must be within a signed 64-bit integer's range; got "
                         f"{priority}")
    if priority and policy != "priority":
        raise ValueError(f"priority: {priority} needs scheduling_policy='priority' (this "
                         f"engine schedules by {policy!r}); send 0 or omit it")


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 block_manager):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_manager = block_manager

    def process(self, request_id, prompt, params, prompt_token_ids, output_kind: str,
                strict_limits: bool) -> ProcessedRequest:
        """Validate and tokenize one request (see `LLMEngine.add_request`)."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind: must be 'cumulative', 'delta', 'final_only' or "
                             f"'delta_ids'; got {output_kind!r}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            # Ids reach logs and metrics labels: bounded, and no newlines to forge log lines.
            raise ValueError(f"request_id: must be at most {MAX_REQUEST_ID_CHARS} printable "
                             "characters")
        if isinstance(prompt, (list, tuple)) and prompt_token_ids is None:
            prompt, prompt_token_ids = None, list(prompt)
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: expected SamplingParams or dict")
        if output_kind == "delta_ids" and not text_free_ok(params):
            raise ValueError("output_kind: 'delta_ids' (outputs without text) needs a request "
                             "without stop strings or beam search")
        ids = self.validate_prompt(prompt, prompt_token_ids)
        samples = params.best_of or params.n
        if samples > self.max_num_seqs:
            raise ValueError(f"n: {samples} samples exceed max_num_seqs={self.max_num_seqs}")
        if strict_limits:
            self.check_growth(len(ids), params.max_tokens, samples)
        return ProcessedRequest(prompt, ids, params, samples)

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt text accepted: far more than `max_model_len` tokens can hold, so
        nothing valid is refused, but a 10 MB prompt is refused before tokenizing it (which
        took 12-17 s and stalled every stream)."""
        return MAX_CHARS_PER_TOKEN * self.max_model_len

    def check_prompt_text(self, prompt, field: str = "prompt") -> None:
        """Checks a prompt's text before any tokenization: type, emptiness, size, Unicode."""
        if not isinstance(prompt, str):
            raise ValueError(f"{field}: expected text or token ids")
        if not prompt:
            raise ValueError(f"{field}: empty prompt")
        if len(prompt) > self.max_prompt_chars:
            raise ValueError(f"{field}: {len(prompt)} characters, at most {self.max_prompt_chars} "
                             f"({MAX_CHARS_PER_TOKEN} per token of max_model_len)")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field}: not valid Unicode text (unpaired surrogate at "
                             f"character {e.start})") from None

    def validate_prompt(self, prompt: str | None, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            self.check_prompt_text(prompt)
            prompt_token_ids = self.tokenizer(prompt).input_ids
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, must be shorter than max_model_len="
                             f"{self.max_model_len}")
        return [int(t) for t in ids]

    def check_growth(self, prompt_len: int, max_tokens: int, samples: int = 1) -> None:
        """Admission control for growth: ValueError naming `max_tokens` unless the prompt plus
        `max_tokens` fits `max_model_len` and `samples` sequences of that length fit the cache."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; at most {self.max_model_len - prompt_len}")
        bm = self.block_manager
        need = bm.worst_case_blocks(prompt_len, prompt_len + max_tokens, samples)
        if need > bm.growth_capacity:
            fit = self.max_output_tokens(prompt_len, samples)
            what = f"{samples} sequences" if samples > 1 else "the sequence"
            raise ValueError(
                f"max_tokens: {what} of prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                f"could need {need} KV blocks, the cache holds {bm.growth_capacity}; lower "
                f"max_tokens (at most {fit} here)" + (" or n/best_of" if samples > 1 else ""))

    def max_output_tokens(self, prompt_len: int, samples: int = 1) -> int:
        """The largest `max_tokens` that `check_growth` accepts (0 if none): the default for
        clients that set none (OpenAI chat), so a default never asks for the impossible."""
        bm = self.block_manager
        lo, hi = 0, max(0, self.max_model_len - prompt_len)
        while lo < hi:  # the block need grows with the length: bisect
            mid = (lo + hi + 1) // 2
            if bm.worst_case_blocks(prompt_len, prompt_len + mid, samples) <= bm.growth_capacity:
                lo = mid
            else:
                hi = mid - 1
        return lo
