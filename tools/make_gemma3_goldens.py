"""Record HF transformers goldens for the packaged Gemma 3 270M GGUF: tests/data/gemma3_goldens.json.

Run by hand in an environment with torch and transformers (the vLLM peer venv has both):

    .venv-vllm/bin/python tools/make_gemma3_goldens.py \\
        ~/.cache/pagedjax/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf tests/data/gemma3_goldens.json

HF loads the same Q4_K_M file (dequantized to fp32), so both sides see identical weights.
HF's GGUF tokenizer adds no BOS, which Gemma needs: the prompts here start with BOS
explicitly, as pagedjax's tokenizer (and llama.cpp) add it. Chat prompts use Gemma's turn
format; generation stops at EOS or <end_of_turn>, as Gemma's generation_config does.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

LOGIT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a quiet village at the edge of a great forest, there lived",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
]
NUM_VOCAB_SAMPLE = 512
MAX_NEW_TOKENS = 40


def chat_text(prompt: str) -> str:
    return f"<bos><start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def main() -> None:
    gguf_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    bos = model.config.bos_token_id
    eos = [model.config.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(model.config.vocab_size, NUM_VOCAB_SAMPLE, replace=False))

    logit_cases = []
    for prompt in LOGIT_PROMPTS:
        text_ids = tok(prompt, add_special_tokens=False).input_ids
        ids = [bos, *text_ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
        top = np.argsort(-logits, axis=-1)[:, :10]
        logit_cases.append({"prompt": prompt, "text_ids": text_ids, "input_ids": ids,
                            "top10_ids": top.tolist(),
                            "top10_logits": np.take_along_axis(logits, top, -1).tolist(),
                            "sample_logits": logits[:, sample].tolist()})

    chat_cases = []
    for prompt in CHAT_PROMPTS:
        text = chat_text(prompt)
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids[0] == bos
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=eos, attention_mask=torch.ones(1, len(ids)))
        new = out[0, len(ids):].tolist()
        chat_cases.append({"prompt": prompt, "chat_text": text, "input_ids": ids,
                           "output_ids": new,
                           "output_text": tok.decode(new, skip_special_tokens=True)})
        print(repr(chat_cases[-1]["output_text"]))

    out_path.write_text(json.dumps({
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "model": gguf_path.name, "eos_token_ids": eos, "vocab_sample": sample.tolist(),
        "logits": logit_cases, "chat": chat_cases}))


if __name__ == "__main__":
    main()
