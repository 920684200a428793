"""`LLM`: the offline Python API (vLLM-compatible in spirit)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict


class LLM:
    """Load a model and generate from prompts.

    `model` is a GGUF file, an HF directory, a `pagedjax convert` checkpoint, or the demo alias
    `"smollm2"` (fetched into the cache on first use).
    """

    def __init__(self, model: str | Path = "smollm2", dtype: str | None = None, **engine_kwargs):
        from models.loader import load_model
        from models.tokenizer import load_tokenizer

        config, params, path = load_model(model, dtype)
        self._init(config, params, load_tokenizer(path), str(model), dtype, **engine_kwargs)

    def _init(self, config, params, tokenizer, model_name: str, dtype, **engine_kwargs) -> None:
        from models.loader import resolve_dtype
        from pagedjax.reference import ReferenceGenerator

        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._ref = ReferenceGenerator(config, params, resolve_dtype(dtype))
        self._counter = 0

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], list(self.tokenizer(prompt["prompt"]).input_ids)
        return None, [int(t) for t in prompt]

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        from pagedjax.reference import RefSampling

        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sps = sampling_params or SamplingParams()
        sps = [sps] * len(prompts) if isinstance(sps, SamplingParams) else list(sps)
        results = []
        for prompt, sp in zip(prompts, sps):
            text, ids = self._prompt_ids(prompt)
            samp = RefSampling(sp.temperature if not sp.is_greedy else 0.0, sp.top_k, sp.top_p,
                               sp.seed or 0)
            eos = () if sp.ignore_eos else tuple(self.config.eos_token_ids) + tuple(
                sp.stop_token_ids or ())
            out = self._ref.generate([ids], sp.max_tokens, samp, eos)[0]
            finish = "stop" if out and out[-1] in eos else "length"
            self._counter += 1
            results.append(RequestOutput(
                str(self._counter), text, ids,
                [CompletionOutput(0, self.tokenizer.decode(out, skip_special_tokens=True), out,
                                  finish_reason=finish)], finished=True))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in convs]
        return self.generate([{"prompt": p, "prompt_token_ids": self.tokenizer(p).input_ids}
                              for p in prompts], sampling_params, use_tqdm)
