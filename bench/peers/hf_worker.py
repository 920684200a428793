"""Hugging Face transformers `generate` as a peer engine for the side-by-side CPU benchmark.

Standalone: run under the peer venv (tools/peers/setup.sh), never imports the repo.

    .venv-vllm/bin/python bench/peers/hf_worker.py --model /work/peers/smollm2-hf --threads 2

Same line protocol as vllm_worker.py: the model loads once; each line on stdin is a JSON job,
each job gets one JSON line on stdout (logs go to stderr):

    job:    {"prompt_ids": [[...], ...], "max_tokens": 128, "ignore_eos": true}
    result: {"seconds": wall time of model.generate for the whole batch,
             "ttft_s": wall time of a max_new_tokens=1 generate on the prompt (one prompt, else null),
             "outputs": [[token ids], ...], "versions": {...}, "threads": N}

Greedy, fp32, transformers' defaults otherwise (SDPA attention, dynamic KV cache). A batch is
left-padded with the pad token and an attention mask. ignore_eos runs with no EOS stopping
(generation_config.eos_token_id = []), so EOS may be generated and generation goes on, as in
vLLM's ignore_eos; without it a sequence ends at its first EOS, which is kept, as vLLM keeps it.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

from protocol import claim_stdout, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (tools/peers/export_hf.py)")
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()

    out = claim_stdout()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    base = copy.deepcopy(model.generation_config)
    eos = base.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    pad = base.pad_token_id if base.pad_token_id is not None else min(eos_ids, default=0)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}

    def generate(prompts: list[list[int]], max_tokens: int, ignore_eos: bool, job=None):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(map(int, p)) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gc = copy.deepcopy(base)
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = gc.min_p = None
        sampling = (job or {}).get("sampling") or {}
        if sampling:  # the job's parameters, nothing else (no default top-k of 50)
            gc.do_sample = True
            for k, v in sampling.items():
                setattr(gc, k, v)
        gc.max_new_tokens = max_tokens
        gc.pad_token_id = pad
        if ignore_eos:
            gc.eos_token_id = []  # None would be refilled from the model's generation_config
        t0 = time.perf_counter()
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        seconds = time.perf_counter() - t0
        outputs = []
        for row in seqs[:, width:].tolist():
            if not ignore_eos:
                for i, t in enumerate(row):
                    if t in eos_ids:
                        row = row[:i + 1]
                        break
            outputs.append(row)
        return seconds, outputs

    generate([[1, 2, 3, 4]], 4, True)  # warm-up
    print(f"hf_worker ready: threads={torch.get_num_threads()} {versions}", file=sys.stderr)

    serve(out, generate, {"versions": versions, "threads": args.threads})

if __name__ == "__main__":
    main()
