"""A JAX-free stand-in for `LLMEngine` so AsyncEngine and status-code tests run in milliseconds.

Each request emits one token per step (text "w0 w1 ...", the whole so far or, with output_kind
"delta", the new token); prompt "boom" fails inside the engine
(`RequestOutput.error`), and clearing `gate` stalls progress so requests pile up as waiting.
"""

from __future__ import annotations

import threading
import time
import types

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams


class FakeEngine:
    model_name = "fake"
    dtype = "float32"
    max_model_len = 64

    def __init__(self, step_s: float = 0.002):
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.engine_config = types.SimpleNamespace(block_size=16, max_num_seqs=8, tensor_parallel_size=1)
        self.runner = types.SimpleNamespace(num_gpu_blocks=32)
        self.model_config = types.SimpleNamespace(vocab_size=100)
        self._reqs: dict[str, dict] = {}
        self._pending: list[RequestOutput] = []
        self.thread_ids: set[int] = set()
        self.steps = 0
        self.added_at: dict[str, int] = {}
        self.asked: dict[str, tuple[int, int]] = {}
        self.priorities: dict[str, int] = {}  # each request's `priority` argument

    @staticmethod
    def tokenizer(text):
        ids = [[1, 2, 3] for _ in text] if isinstance(text, list) else [1, 2, 3]
        return types.SimpleNamespace(input_ids=ids)

    def max_output_tokens(self, prompt_len, samples=1):
        return max(0, self.max_model_len - prompt_len)

    def check_prompt_text(self, prompt, field="prompt"):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{field}: empty prompt")

    healthy = True
    resets = 0  # `reset_prefix_cache` calls

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def add_request(self, request_id, prompt, params=None, prompt_token_ids=None, arrival_time=None,
                    strict_limits=False, output_kind="cumulative", priority=0):
        self.thread_ids.add(threading.get_ident())
        self.priorities[request_id] = priority
        if request_id in self._reqs:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if prompt_token_ids is None and not prompt:
            raise ValueError("prompt: empty prompt")
        ids = list(prompt_token_ids or [1, 2, 3])
        if any(not 0 <= t < 100 for t in ids):
            raise ValueError("prompt_token_ids: token id outside the vocabulary")
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params or {})
        # "delta": each output carries only the tokens since the previous one ("sent").
        self._reqs[request_id] = {"prompt": prompt, "ids": ids, "sp": sp, "out": [],
                                  "delta": output_kind == "delta", "sent": 0}
        self.added_at[request_id] = self.steps  # the engine step count when it was admitted
        self.asked[request_id] = (len(ids), sp.max_tokens)  # prompt length, max_tokens asked

    def _output(self, rid, r, finished, reason=None, error=None):
        new = r["out"][r["sent"]:] if r["delta"] else r["out"]
        if r["delta"]:
            r["sent"] = len(r["out"])
        text = "".join(f"w{t} " for t in new)
        comp = CompletionOutput(0, text, list(new), finish_reason=reason)
        return RequestOutput(rid, r["prompt"], r["ids"], [comp], finished=finished, error=error)

    def abort_request(self, request_id, withdraw=False):
        self.thread_ids.add(threading.get_ident())
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            r = self._reqs.pop(rid, None)
            if r is not None and not withdraw:
                self._pending.append(self._output(rid, r, True, "abort"))

    def has_unfinished_requests(self):
        return bool(self._reqs) or bool(self._pending)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        outs, self._pending = self._pending, []
        time.sleep(self.step_s)
        if not self.gate.is_set():
            return outs
        self.steps += 1
        for rid, r in list(self._reqs.items()):
            if r["prompt"] == "boom":
                del self._reqs[rid]
                outs.append(self._output(rid, r, True, "abort", error="internal error: boom"))
                continue
            r["out"].append(len(r["out"]))
            done = len(r["out"]) >= r["sp"].max_tokens
            if done:
                del self._reqs[rid]
            outs.append(self._output(rid, r, done, "length" if done else None))
        return outs

    def get_stats(self):
        used = 2 * len(self._reqs)
        return types.SimpleNamespace(
            num_running=len(self._reqs), num_waiting=0, num_swapped=0, num_gpu_blocks=32,
            num_free_gpu_blocks=32 - used, kv_cache_usage=used / 32, num_preemptions_total=0,
            num_steps=self.steps, prompt_tokens_total=0, generation_tokens_total=0,
            healthy=self.healthy)


class FailingStepEngine(FakeEngine):
    """A step with a request whose prompt is "crash" raises (an engine bug, not a request's)."""

    def step(self):
        if any(r["prompt"] == "crash" for r in self._reqs.values()):
            raise RuntimeError("step failed")
        return super().step()


def failing_factory(message: str):
    """An engine factory that fails, as a model that does not load."""
    raise RuntimeError(message)


class StepStampEngine(FakeEngine):
    """Reports, as each output's `num_cached_tokens`, the step count when its request was
    admitted: tests then see from outside a process how admissions fell between steps."""

    def _output(self, rid, r, finished, reason=None, error=None):
        out = super()._output(rid, r, finished, reason, error)
        out.num_cached_tokens = self.added_at.get(rid, -1)
        return out


class ResetStampEngine(FakeEngine):
    """Reports, as each output's `num_cached_tokens`, how many prefix-cache resets the engine
    had applied when its request was added."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.resets_at_add: dict[str, int] = {}

    def add_request(self, request_id, *a, **k):
        super().add_request(request_id, *a, **k)
        self.resets_at_add[request_id] = self.resets

    def _output(self, rid, r, finished, reason=None, error=None):
        out = super()._output(rid, r, finished, reason, error)
        out.num_cached_tokens = self.resets_at_add.get(rid, -1)
        return out


class PriorityStampEngine(FakeEngine):
    """Reports, as each output's `num_cached_tokens`, the `priority` its request was added
    with: tests then see from outside a process that the argument arrived."""

    def _output(self, rid, r, finished, reason=None, error=None):
        out = super()._output(rid, r, finished, reason, error)
        out.num_cached_tokens = self.priorities.get(rid, -1)
        return out
