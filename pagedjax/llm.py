"""`LLM`: the offline Python API (vLLM-compatible in spirit), driving the paged `LLMEngine`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

from pagedjax.config import EngineConfig
from pagedjax.core.block_manager import PrefixHandle
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict


class LLM:
    """Load a model and generate with the paged engine.

    `model` is a GGUF file, an HF directory, a `pagedjax convert` checkpoint, or the demo alias
    `"smollm2"` (fetched into the cache on first use). Keyword arguments are `EngineConfig`
    fields (block_size, num_gpu_blocks, gpu_memory_utilization, max_num_seqs,
    max_num_batched_tokens, max_model_len, preemption_mode, swap_space_gb, ...).
    """

    def __init__(self, model: str | Path = "smollm2", dtype: str | None = None, **engine_kwargs):
        from pagedjax.engine import LLMEngine

        self._attach(LLMEngine.from_model(str(model), dtype, **engine_kwargs))

    @classmethod
    def from_params(cls, config, params, tokenizer, dtype=None, model_name: str = "in-memory",
                    **engine_kwargs) -> LLM:
        """Build from an in-memory params pytree (e.g. inside a training loop)."""
        import jax

        from pagedjax.engine import LLMEngine

        self = cls.__new__(cls)
        # The compute dtype: the final norm's (packed weights hold integer codes and
        # float16 scales beside the model's own dtype).
        dt = dtype or (params["final_norm"].dtype if "final_norm" in params
                       else jax.tree.leaves(params)[0].dtype)
        self._attach(LLMEngine(config, params, tokenizer, EngineConfig(**engine_kwargs), dt, model_name))
        return self

    def _attach(self, engine) -> None:
        self.engine = engine
        self.config = engine.model_config
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def update_params(self, params: dict) -> None:
        """Swap in new weights without recompiling or reallocating the KV cache."""
        self.engine.update_params(params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `LLM.reset_prefix_cache`): later prompts are
        computed in full. Registered prefixes are unpinned."""
        return self.engine.reset_prefix_cache()

    def register_prefix(self, prefix: str | Sequence[int]) -> PrefixHandle:
        """Explicit shared prefix (paper §4.4): compute its KV once and pin its full blocks.

        Runs the prefix as a one-token request so its blocks are computed and published in the
        prefix cache, then pins them so they are never evicted; later prompts starting with the
        same tokens reuse them. A trailing partial block is not pinned (only full blocks are
        shareable). Needs `enable_prefix_caching=True`. Release with `unpin_prefix`; a weight
        swap (`update_params`) invalidates every handle.
        """
        if not self.engine.engine_config.enable_prefix_caching:
            raise ValueError("register_prefix requires enable_prefix_caching=True")
        ids = self.tokenizer(prefix).input_ids if isinstance(prefix, str) else [int(t) for t in prefix]
        handle = self.engine.register_prefix(ids)  # pins blocks as soon as they are computed
        if not handle.complete:
            self.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)
        if not handle.complete:
            self.engine.unpin_prefix(handle)
            raise RuntimeError("register_prefix: the prefix's blocks could not be cached")
        return handle

    def unpin_prefix(self, handle: PrefixHandle) -> None:
        """Let a registered prefix's blocks become evictable again."""
        self.engine.unpin_prefix(handle)

    def get_tokenizer(self):
        return self.tokenizer

    def _add(self, prompt: PromptType, params: SamplingParams, kind: str = "cumulative",
             priority: int = 0) -> str:
        rid = f"llm-{next(self._ids)}"
        if isinstance(prompt, str):
            self.engine.add_request(rid, prompt, params, output_kind=kind, priority=priority)
        elif isinstance(prompt, dict):
            self.engine.add_request(rid, prompt.get("prompt"), params,
                                    prompt_token_ids=prompt.get("prompt_token_ids"),
                                    output_kind=kind, priority=priority)
        else:
            self.engine.add_request(rid, None, params, prompt_token_ids=list(prompt),
                                    output_kind=kind, priority=priority)
        return rid

    @staticmethod
    def _priorities(priority: int | Sequence[int] | None, n: int) -> list[int]:
        """One priority per prompt (vLLM's `priority=` list; one int for all here too)."""
        if priority is None:
            return [0] * n
        if isinstance(priority, int):
            return [priority] * n
        priority = list(priority)
        if len(priority) != n:
            raise ValueError(f"priority: need one per prompt ({n}) or a single one; got "
                             f"{len(priority)}")
        return priority

    @staticmethod
    def _normalize(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        sps = sampling_params or SamplingParams()
        sps = [sps] * len(prompts) if isinstance(sps, SamplingParams) else list(sps)
        if len(sps) != len(prompts):
            raise ValueError("sampling_params: need one per prompt or a single one")
        return prompts, sps

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. ``priority`` (with
        `scheduling_policy="priority"`): lower values are scheduled first."""
        prompts, sps = self._normalize(prompts, sampling_params)
        prios = self._priorities(priority, len(prompts))
        rids: list[str] = []
        try:
            for prompt, sp, prio in zip(prompts, sps, prios):
                rids.append(self._add(prompt, sp, "final_only", prio))
        except Exception:
            self.engine.abort_request(rids)
            self.engine.step()  # drain the abort outputs
            raise
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(rids) > 8:
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req")
        wanted = set(rids)
        try:
            while len(finished) < len(rids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(finished) < len(rids):
                    raise RuntimeError("engine stopped with requests unfinished")
        except BaseException:
            self.engine.abort_request([r for r in rids if r not in finished])
            self.engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in rids]

    def generate_stream(self, prompts: PromptType | Sequence[PromptType],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        priority: int | Sequence[int] | None = None,
                        ) -> Iterator[RequestOutput]:
        """Yield incremental `RequestOutput`s (cumulative text) as steps complete."""
        prompts, sps = self._normalize(prompts, sampling_params)
        prios = self._priorities(priority, len(prompts))
        rids: list[str] = []
        try:
            for p, sp, prio in zip(prompts, sps, prios):
                rids.append(self._add(p, sp, priority=prio))
        except Exception:
            self.engine.abort_request(rids)
            self.engine.step()  # drain the abort outputs
            raise
        pending = set(rids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
            # Async scheduling may have launched one more step before the last finish was
            # known: with nothing else to run, collect it so the engine is idle on return.
            while (self.engine.get_num_unfinished_requests() == 0
                   and self.engine.has_unfinished_requests()):
                self.engine.step()
        finally:
            if pending:
                self.engine.abort_request(list(pending))
                self.engine.step()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            # The template writes any BOS itself: tokenizing must not add another.
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)
