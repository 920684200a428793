"""Result objects returned by `LLM.generate` (shaped like vLLM's)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)  # one per request per step while streaming
class CompletionOutput:
    """One generated sequence of a request (`index` distinguishes the n samples)."""

    index: int
    text: str
    token_ids: list[int]
    # Sum of the sampled tokens' raw logprobs; None unless the request asked for logprobs
    # (`logprobs` >= 0, as in vLLM V1) or searched beams: greedy rows without logprobs may
    # take their tokens from the screened LM head, which computes no log-sum-exp.
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # time.monotonic() when the request was first scheduled (its queue time ends), if it was.
    first_scheduled_time: float | None = None


_new = object.__new__


def running_delta(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  index: int, text: str, token_ids: list[int], num_cached_tokens: int,
                  first_scheduled_time: float | None, cumulative_logprob: float | None = None,
                  logprobs: list[dict[int, float]] | None = None) -> RequestOutput:
    """The `RequestOutput` of one running sequence's streamed step (nothing finished, no
    prompt logprobs): what ``RequestOutput(request_id, prompt, prompt_token_ids,
    [CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs)], False, None,
    num_cached_tokens, None, first_scheduled_time)`` makes, built without the two dataclass
    ``__init__`` calls.

    Every in-process stream gets one a step, and the calls were most of its cost: 0.83 us a
    row against 1.02 in the stream loop (`OutputProcessor.stream_rows`), ~0.05 ms of a
    256-row step. Every field is set (`tests/engine/test_outputs.py` checks this against
    the dataclasses' fields, so a new field cannot be missed)."""
    c = _new(CompletionOutput)
    c.index = index
    c.text = text
    c.token_ids = token_ids
    c.cumulative_logprob = cumulative_logprob
    c.logprobs = logprobs
    c.finish_reason = None
    c.stop_reason = None
    o = _new(RequestOutput)
    o.request_id = request_id
    o.prompt = prompt
    o.prompt_token_ids = prompt_token_ids
    o.outputs = [c]
    o.finished = False
    o.prompt_logprobs = None
    o.num_cached_tokens = num_cached_tokens
    o.error = None
    o.first_scheduled_time = first_scheduled_time
    return o
