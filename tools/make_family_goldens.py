"""Record HF transformers goldens for every supported model family: tests/data/family_goldens.json.

Run by hand in an environment with torch and transformers (the vLLM peer venv has both):

    .venv-vllm/bin/python tools/make_family_goldens.py tests/data/family_goldens.json

For each family a small config shaped like the real models (few layers, real head ratios,
the family's rope / window / soft-cap / norm / expert settings, at toy widths) is built with
HF's own config class, its weights are filled by `models.synthetic` (deterministic from each
tensor's name, so the goldens list names and shapes instead of carrying weights), and HF's
eager implementation records prompt logits and greedy continuations (with its KV cache, as
`generate` runs). `tests/model/test_families.py` rebuilds the same checkpoint without torch
and compares pagedjax against these numbers. HF's own rotary functions are recorded too, so
the rope variants are checked against HF's definitions rather than against ours.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import synthetic  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
WINDOW = 8  # prompts and continuations run well past it

FAMILIES: dict[str, dict] = {
    "llama3": dict(model_type="llama", num_hidden_layers=2,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    "mistral": dict(model_type="mistral", num_hidden_layers=2, sliding_window=WINDOW,
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2, tie_word_embeddings=True,
                  max_position_embeddings=24,  # decode crosses it: dynamic NTK rescales
                  rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2-window": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True,
                         sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, head_dim=32,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "phi3": dict(model_type="phi3", num_hidden_layers=2, num_key_value_heads=4, head_dim=None,
                 # below 64 tokens: HF re-rotates a whole sequence once it passes the original
                 # length (models.rope rotates per token), so the comparison stays short of it
                 max_position_embeddings=256, original_max_position_embeddings=64,
                 sliding_window=WINDOW * 2,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                  "long_factor": [1.5 + 0.5 * i for i in range(8)]}),
    "gemma2": dict(model_type="gemma2", num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                   query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=3.0,
                   final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=3, head_dim=32,
                   tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                          "factor": 8.0}}),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(model_type="qwen2_moe", num_hidden_layers=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}

# HF's rotary definitions, recorded for the variants (config fields, head_dim 32).
ROPE_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
             "original_max_position_embeddings": 512},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 4096},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0 + 0.05 * i for i in range(16)],
                 "long_factor": [2.0 + 0.3 * i for i in range(16)]},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}
ROPE_SEQ_LENS = (100, 3000, 9000)
PROMPT_LENGTHS = (5, 13, 21)
NEW_TOKENS = 24


def family_config(name: str):
    kw = {**COMMON, **FAMILIES[name]}
    model_type = kw.pop("model_type")
    if kw.get("head_dim") is None:
        kw.pop("head_dim")
    return AutoConfig.for_model(model_type, **kw)


def record_family(name: str, rng: np.random.Generator) -> dict:
    config = family_config(name)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32).eval()
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shapes = {k: list(v.shape) for k, v in state.items()
              if not (tied and k == "lm_head.weight") and "rotary_emb" not in k}
    gemma = config.model_type.startswith("gemma")
    weights = synthetic.tensors(shapes, gemma=gemma)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()},
                                                strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if tied:
        model.tie_weights()
    # No stop token: greedy runs the full length, and no logits processor (min_new_tokens
    # would ban EOS) touches the argmax.
    model.generation_config.eos_token_id = None
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in PROMPT_LENGTHS]
    cases = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 use_cache=True)
        assert out.shape[1] == len(ids) + NEW_TOKENS
        cases.append({"input_ids": ids, "logits": np.round(logits, 6).tolist(),
                      "greedy": out[0, len(ids):].tolist()})
    return {"config": json.loads(config.to_json_string()), "tensors": shapes, "cases": cases}


def record_rope() -> dict:
    out = {}
    for name, params in ROPE_CASES.items():
        kind = params["rope_type"]
        cfg = AutoConfig.for_model("llama", hidden_size=128, num_attention_heads=4, head_dim=32,
                                   max_position_embeddings=2048, rope_parameters=dict(params))
        rows = []
        for seq_len in ROPE_SEQ_LENS:
            inv, attn = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
            rows.append({"seq_len": seq_len, "inv_freq": inv.double().tolist(),
                         "attention_factor": float(attn)})
        out[name] = {"rope_parameters": params, "head_dim": 32, "max_position_embeddings": 2048,
                     "rows": rows}
    return out


def main() -> None:
    out_path = Path(sys.argv[1])
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)
    data = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "families": {name: record_family(name, rng) for name in FAMILIES},
        "rope": record_rope(),
    }
    out_path.write_text(json.dumps(data, separators=(",", ":")))
    print(f"wrote {out_path} ({out_path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
