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
