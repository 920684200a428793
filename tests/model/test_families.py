"""Every supported family against HF transformers, on random weights shaped like the real models.

`tools/make_family_goldens.py` recorded HF's logits and greedy continuations (eager attention,
fp32, its KV cache) for small configs of each family; the weights are rebuilt here from
`models.synthetic` by tensor name, written as an HF folder in the family's own tensor layout
(Phi-3's fused projections, transformers v5's fused experts) and loaded by the same loader
users call. The engine runs them with preemption and prefix caching on, in both layer loops.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from models import rope, synthetic
from models.config import ModelConfig
from models.loader import load_model
from pagedjax import LLM, SamplingParams
from pagedjax.reference import ReferenceGenerator
from tests.conftest import DATA
from tests.engine.test_engine_e2e import assert_pool_whole
from tests.parallel.tp_script import NoTokenizer

GOLDENS = json.loads((DATA / "family_goldens.json").read_text())
FAMILIES = sorted(GOLDENS["families"])
# fp32 on both sides; differences come from summation order (and XLA's tanh/exp) only.
LOGIT_TOL = 2e-4


def write_family(name: str, path) -> None:
    fam = GOLDENS["families"][name]
    gemma = fam["config"]["model_type"].startswith("gemma")
    save_file(synthetic.tensors(fam["tensors"], gemma=gemma), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(fam["config"]))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_family(request.param, path)
    config, params, _ = load_model(path, dtype="float32")
    return request.param, config, params


def test_config_reads_family_switches():
    cfg = {n: ModelConfig.from_hf(GOLDENS["families"][n]["config"]) for n in FAMILIES}
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and cfg["qwen2"].tie_word_embeddings
    assert cfg["qwen3"].qk_norm and not cfg["qwen3"].qkv_bias
    assert cfg["mistral"].windows == (8, 8) and cfg["mistral"].max_window == 8
    assert cfg["qwen2-window"].windows == (0, 8, 8) and cfg["qwen2-window"].max_window == 0
    assert cfg["gemma2"].windows == (8, 0) and cfg["gemma2"].attn_softcap == 3.0
    assert cfg["gemma2"].final_softcap == 5.0 and cfg["gemma2"].softmax_scale == 24 ** -0.5
    g3 = cfg["gemma3"]
    assert g3.windows == (8, 8, 0) and g3.rope_local_theta == 10000.0 and g3.rope_theta == 1e6
    assert dict(g3.rope_scaling)["rope_type"] == "linear" and g3.qk_norm and g3.sandwich_norm
    assert cfg["phi3"].windows == (16, 16) and dict(cfg["phi3"].rope_scaling)["rope_type"] == "longrope"
    assert cfg["mixtral"].num_experts == 4 and cfg["mixtral"].norm_topk_prob
    assert not cfg["qwen2_moe"].norm_topk_prob and cfg["qwen2_moe"].shared_expert_intermediate_size == 48
    assert cfg["qwen3_moe"].num_experts == 6 and cfg["qwen3_moe"].qk_norm


def test_prompt_logits_match_hf(family):
    name, config, params = family
    ref = ReferenceGenerator(config, params)
    for case in GOLDENS["families"][name]["cases"]:
        want = np.asarray(case["logits"], np.float32)
        got = ref.prompt_logits(case["input_ids"])
        np.testing.assert_allclose(got, want, atol=LOGIT_TOL * np.abs(want).max(), rtol=0,
                                   err_msg=name)


def test_reference_greedy_matches_hf(family):
    name, config, params = family
    cases = GOLDENS["families"][name]["cases"]
    outs = ReferenceGenerator(config, params).generate(
        [c["input_ids"] for c in cases], len(cases[0]["greedy"]), eos_token_ids=())
    for out, case in zip(outs, cases, strict=True):
        assert out == case["greedy"], name


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_engine_greedy_matches_hf_under_preemption_and_prefix_cache(family, loop):
    """Paged kernels (windows, soft-caps), both layer loops, recompute preemption forced by a
    small pool, prefix caching on with a shared prompt head: HF's tokens exactly."""
    name, config, params = family
    cases = GOLDENS["families"][name]["cases"]
    new = len(cases[0]["greedy"])
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=14, block_size=8,
                          max_num_seqs=3, max_model_len=64, enable_prefix_caching=True,
                          layer_loop=loop)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    prompts = [c["input_ids"] for c in cases] * 2  # repeats hit the prefix cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for out, case in zip(outs, cases * 2, strict=True):
        assert out.outputs[0].token_ids == case["greedy"], (name, loop)
    if not config.max_window:  # all-windowed models release blocks instead of preempting
        assert llm.engine.get_stats().num_preemptions_total > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize("case", sorted(GOLDENS["rope"]))
def test_rope_variants_match_hf(case):
    """Our frequencies against HF's own functions. Position p of a token is rotated with what
    HF uses for a sequence of p + 1 tokens (the per-token rule of `models.rope`)."""
    g = GOLDENS["rope"][case]
    params = dict(g["rope_parameters"])
    scaling = None if params["rope_type"] == "default" else rope.freeze(
        {k: v for k, v in params.items() if k != "rope_theta"})
    rope.validate(scaling)
    for row in g["rows"]:
        pos = np.asarray([row["seq_len"] - 1], np.int32)
        cos, sin = rope.tables(pos, g["head_dim"], params["rope_theta"], scaling,
                               g["max_position_embeddings"])
        cos, sin = np.asarray(cos, np.float64)[0], np.asarray(sin, np.float64)[0]
        attn = float(np.sqrt(cos[0] ** 2 + sin[0] ** 2))
        np.testing.assert_allclose(attn, row["attention_factor"], rtol=1e-5, err_msg=case)
        angles = np.asarray(row["inv_freq"]) * (row["seq_len"] - 1)
        np.testing.assert_allclose(cos, attn * np.cos(angles), atol=2e-3, err_msg=case)
        np.testing.assert_allclose(sin, attn * np.sin(angles), atol=2e-3, err_msg=case)


def test_orbax_checkpoint_round_trip(family, tmp_path):
    """`pagedjax convert` output for every family: same config, bit-identical params."""
    import jax

    from models.checkpoint import load_checkpoint, save_checkpoint

    name, config, params = family
    path = save_checkpoint(tmp_path / name, config, params)
    config2, params2 = load_checkpoint(path)
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generation_config_eos_ids_are_honoured(tmp_path):
    """Chat models stop on several ids (generation_config.json), as HF's generate does."""
    write_family("qwen2", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    config, params, _ = load_model(tmp_path, dtype="float32")
    assert set(config.eos_token_ids) == {2, 7, 11}
    ids = GOLDENS["families"]["qwen2"]["cases"][2]
    stop_at = ids["greedy"][5]  # make the sixth greedy token a stop id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at]}))
    config, params, _ = load_model(tmp_path, dtype="float32")
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=32, block_size=8,
                          max_model_len=64)
    out = llm.generate([{"prompt_token_ids": ids["input_ids"]}],
                       SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    first = ids["greedy"].index(stop_at)
    assert out.token_ids == ids["greedy"][: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_pallas_kernels_in_the_engine_match_hf(tmp_path, name):
    """The Pallas kernels (interpreted on CPU) inside the engine: traced per-layer windows under
    the layer scan, soft-capping, released blocks (Mistral) — HF's greedy tokens."""
    write_family(name, tmp_path)
    config, params, _ = load_model(tmp_path, dtype="float32")
    case = GOLDENS["families"][name]["cases"][2]
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=16, block_size=8,
                          max_model_len=64, attention_backend="pallas", layer_loop="scan")
    out = llm.generate([{"prompt_token_ids": case["input_ids"]}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == case["greedy"][:12]
    assert_pool_whole(llm)
