"""Export the demo GGUF as a Hugging Face folder (fp32 safetensors) for the peer engines.

Run with the peer venv's python (torch, transformers, gguf, accelerate; no repo imports):

    .venv-vllm/bin/python tools/peers/export_hf.py --gguf PATH.gguf --out DIR

transformers dequantizes the GGUF (undoing llama.cpp's Q/K row permutation) but refuses to
`save_pretrained` a model loaded from GGUF, so the weights are copied into a fresh
LlamaForCausalLM and that is saved. Tied embeddings stay tied (no separate lm_head tensor).
The folder is reloaded and its logits are checked against the GGUF-loaded model's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    gguf = args.gguf.resolve()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32)
    src.eval()
    config = copy.deepcopy(src.config)
    config.dtype = torch.float32
    # The GGUF load leaves a gguf quantization_config behind; the export is plain fp32, and a
    # peer engine that saw it would try to load the folder as a GGUF-quantized model.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = ""
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # lm_head.weight may be absent from a tied state dict; anything else is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        sys.exit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != \
            model.model.embed_tokens.weight.data_ptr():
        sys.exit("lm_head is not tied to embed_tokens after load")
    model.save_pretrained(out, safe_serialization=True)

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)
    gen = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                           else config.eos_token_id)
    gen.save_pretrained(out)

    # Round trip: the saved folder must give the GGUF model's logits exactly.
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        a = src(ids).logits
        b = back(ids).logits
    diff = (a - b).abs().max().item()
    tied = (back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr())
    report = {"out": str(out), "params": sum(p.numel() for p in back.parameters()),
              "tie_word_embeddings": bool(config.tie_word_embeddings), "reloaded_tied": tied,
              "max_abs_logit_diff": diff,
              "files": sorted(p.name for p in out.iterdir())}
    saved = json.loads((out / "config.json").read_text())
    report["config_has_quantization"] = "quantization_config" in saved
    print(json.dumps(report, indent=1))
    if diff != 0.0 or (config.tie_word_embeddings and not tied) or \
            report["config_has_quantization"]:
        sys.exit("round trip changed the model")


if __name__ == "__main__":
    main()
