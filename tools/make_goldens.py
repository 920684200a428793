"""Produce tests/data/hf_goldens.json with HF transformers (+torch) on the demo GGUF.

Run once by hand, in an environment with torch, transformers, accelerate and gguf:

    python tools/make_goldens.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/hf_goldens.json

torch is not a dependency of pagedjax; the tests compare against this file, and additionally
against live HF when torch is importable. The versions used are recorded in the output.
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
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote, "
    "previously unexplored valley in the Andes Mountains. Even more surprising to the "
    "researchers was the fact that the unicorns spoke perfect English.",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean.",
    "Explain in a few sentences what a hash table is.",
    "Give me three tips for learning to cook.",
]
NUM_VOCAB_SAMPLE = 512
MAX_NEW_TOKENS = 48


def main() -> None:
    gguf_path = Path(sys.argv[1])
    out_path = Path(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype=torch.float32)
    model.eval()
    rng = np.random.default_rng(0)
    vocab_sample = np.sort(rng.choice(model.config.vocab_size, NUM_VOCAB_SAMPLE, replace=False))

    logits_cases = []
    for prompt in LOGIT_PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
        top = np.argsort(-logits, axis=-1)[:, :10]
        logits_cases.append({
            "prompt": prompt,
            "input_ids": ids,
            "top10_ids": top.tolist(),
            "top10_logits": np.take_along_axis(logits, top, -1).tolist(),
            "sample_logits": logits[:, vocab_sample].tolist(),
            "last_logits": logits[-1].tolist(),
        })

    chat_cases = []
    for prompt in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, attention_mask=torch.ones(1, len(ids)))
        new = out[0, len(ids):].tolist()
        chat_cases.append({"prompt": prompt, "chat_text": text, "input_ids": ids,
                           "output_ids": new,
                           "output_text": tok.decode(new, skip_special_tokens=True)})

    result = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "numpy": np.__version__},
        "model": gguf_path.name,
        "eos_token_id": tok.eos_token_id,
        "vocab_sample": vocab_sample.tolist(),
        "logits": logits_cases,
        "chat": chat_cases,
    }
    out_path.write_text(json.dumps(result))
    for c in chat_cases:
        print(repr(c["output_text"]), len(c["output_ids"]))


if __name__ == "__main__":
    main()
