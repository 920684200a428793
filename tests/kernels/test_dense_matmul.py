"""The native float32 panel matmul (`pallas_kernels/csrc/dense_matmul_cpu.cc`) against float64
numpy, over row counts around its 6-row register block, its 64-row work items and the grouped
panels of steps of up to three rows, depths that are
not multiples of the vector width, widths with partial last panels; its rows do not depend on
how many rows come with them; the panel layout and the embedding lookup from it; bad
arguments refused; and the model with panelized weights against XLA's dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qlinear import dense_panel_rows, dense_panelize, to_dense_panels
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")

_mm = jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 48, 49, 65, 100, 130, 256, 257, 544,
                               2048])
@pytest.mark.parametrize("k,n", [(576, 960), (100, 1), (37, 63), (64, 65), (1536, 200),
                                 (50, 64 * 9 + 5), (33, 64 * 7)])
def test_matches_float64(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = np.asarray(_mm(jnp.asarray(x), to_dense_panels(jnp.asarray(w)), n), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (m, n)
    # fp32 accumulation over k terms: error grows like sqrt(k) * eps * |x||w|
    tol = 4 * np.sqrt(k) * np.finfo(np.float32).eps * np.abs(x).max() * np.abs(w).max()
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


def test_rows_do_not_depend_on_the_batch():
    """A row's result is bit-identical alone, with one or two others (panels read in groups),
    in a 6-row block, in a partial block, in a later work item of up to 66 rows and in an item cut
    between threads (the batch's items do not divide evenly: 5 panels x 3 chunks at 130
    rows): a sequence scores the same in a decode step and in a speculative verification
    step."""
    rng = np.random.default_rng(7)
    w = to_dense_panels(jnp.asarray(rng.standard_normal((576, 300)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((200, 576)), jnp.float32)
    whole = np.asarray(_mm(x, w, 300))
    np.testing.assert_array_equal(np.asarray(_mm(x[:130], w, 300)), whole[:130])
    np.testing.assert_array_equal(np.asarray(_mm(x[:64], w, 300)), whole[:64])
    # chunks on register-block boundaries (65 rows: 36 + 29; 200: 54 x 3 + 38) and the last
    # 7-9 rows of a chunk as two blocks (9 rows: 5 + 4)
    for rows in (9, 65, 199):
        np.testing.assert_array_equal(np.asarray(_mm(x[:rows], w, 300)), whole[:rows])
    # long steps: 60-row chunks; 544 rows: 8 of them and a last of 64 (4 left over join it)
    big = jnp.asarray(rng.standard_normal((2048, 576)), jnp.float32)
    all_rows = np.asarray(_mm(big, w, 300))
    np.testing.assert_array_equal(np.asarray(_mm(big[:544], w, 300)), all_rows[:544])
    for r in (0, 478, 479, 480, 538, 542, 2040, 2046):
        np.testing.assert_array_equal(np.asarray(_mm(big[r:r + 2], w, 300)), all_rows[r:r + 2])
    for r in (0, 5, 6, 47, 48, 60, 64, 67, 130, 197):
        for rows in (1, 2, 3):
            np.testing.assert_array_equal(np.asarray(_mm(x[r:r + rows], w, 300)),
                                          whole[r:r + rows])
    np.testing.assert_array_equal(np.asarray(_mm(x[3:11], w, 300)), whole[3:11])


@pytest.mark.parametrize("live", [0, 1, 5, 63, 64, 65, 129, 200, 250, -3])
def test_live_rows_multiply_the_first_rows_and_zero_the_rest(live):
    """``live_rows`` (a bucketed step's real tokens): the first ``live`` rows are exactly what
    the whole batch gives them, every later row is zeros even where the output buffer held
    something else before (NaN x rows, a reused buffer), and counts outside [0, M] clamp."""
    rng = np.random.default_rng(11)
    w = to_dense_panels(jnp.asarray(rng.standard_normal((576, 300)), jnp.float32))
    x = np.asarray(rng.standard_normal((200, 576)), np.float32)
    whole = np.asarray(_mm(jnp.asarray(x), w, 300))
    x[max(live, 0):] = np.nan  # padding rows: never read
    mm = jax.jit(lambda x, w, live: cpu_native.dense_matmul_cpu(x, w, 300, live))
    for _ in range(2):  # the second call may get the first one's buffer back
        got = np.asarray(mm(jnp.asarray(x), w, jnp.int32(live)))
        n = min(max(live, 0), 200)
        np.testing.assert_array_equal(got[:n], whole[:n])
        np.testing.assert_array_equal(got[n:], 0.0)


def test_packed_matmul_passes_live_rows_to_panels():
    rng = np.random.default_rng(12)
    w = to_dense_panels(jnp.asarray(rng.standard_normal((64, 70)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)  # leading axes flatten
    got = np.asarray(jax.jit(lambda x: cpu_native.packed_matmul_cpu(
        x, {"panels": w}, 70, live_rows=jnp.int32(5)))(x))
    whole = np.asarray(_mm(x, w, 70)).reshape(12, 70)
    np.testing.assert_array_equal(got.reshape(12, 70)[:5], whole[:5])
    np.testing.assert_array_equal(got.reshape(12, 70)[5:], 0.0)
    assert cpu_native.packed_matmul_cpu.takes_live_rows


def test_leading_axes_and_panel_layout():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((96, 130)), jnp.float32)
    p = to_dense_panels(w)
    assert p.shape == (3, 96, 64)
    np.testing.assert_array_equal(np.asarray(p[2, :, 2:]), 0.0)  # padding columns are zero
    x = jnp.asarray(rng.standard_normal((2, 3, 96)), jnp.float32)
    got = cpu_native.dense_matmul_cpu(x, p, 130)
    assert got.shape == (2, 3, 130)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                               atol=1e-4)
    # The tied embedding: panels of embed.T, rows looked up through the layout.
    emb = jnp.asarray(rng.standard_normal((130, 96)), jnp.float32)
    ids = jnp.asarray([0, 129, 64, 63, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(dense_panel_rows(to_dense_panels(emb.T), ids)),
                                  np.asarray(emb)[[0, 129, 64, 63, 7]])


def test_panelize_converts_float32_kernels_and_the_head_only():
    params = {"embed": jnp.ones((130, 8)), "final_norm": jnp.ones(8),
              "layer_0": {"o_proj": {"kernel": jnp.ones((8, 8)), "bias": jnp.zeros(8)},
                          "router": jnp.ones((8, 4)),
                          "down_proj": {"kernel": jnp.ones((8, 8), jnp.bfloat16)}}}
    out = dense_panelize(params)
    assert out["embed"]["panels"].shape == (3, 8, 64)
    assert set(out["layer_0"]["o_proj"]) == {"panels", "bias"}
    assert out["layer_0"]["router"].shape == (8, 4)  # a raw param, not a Linear kernel
    assert "kernel" in out["layer_0"]["down_proj"]  # not float32: XLA's dot keeps it


def test_bad_arguments_are_refused():
    p = to_dense_panels(jnp.ones((64, 100), jnp.float32))
    with pytest.raises(Exception, match="panels"):
        cpu_native.dense_matmul_cpu(jnp.ones((1, 48), jnp.float32), p, 100)  # K mismatch
    with pytest.raises(Exception, match="panels"):
        cpu_native.dense_matmul_cpu(jnp.ones((1, 64), jnp.float32), p, 200)  # N too wide
    with pytest.raises(TypeError, match="float32"):
        cpu_native.dense_matmul_cpu(jnp.ones((1, 64), jnp.bfloat16), p, 100)


@pytest.mark.parametrize("tied", [False, True])
def test_model_logprobs_match_xla_dots(monkeypatch, tied):
    """The unrolled fp32 model with its kernels and LM head in panels (the CPU serving
    default) against the same model on XLA's dots (``PAGEDJAX_DENSE_PANELS=0``): same greedy
    tokens, top logprobs within float reassociation error, over a prefill and decode steps;
    tied (the head read through the embedding's panels) and untied heads."""
    from models.config import ModelConfig
    from models.weights import assemble_params
    from pagedjax import LLM, SamplingParams
    from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
    from tests.parallel.tp_script import NoTokenizer

    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "tie_word_embeddings": tied})
    params = assemble_params(config, random_hf_tensors(config, seed=3).get)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, n)] for n in (7, 30, 3)]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDJAX_DENSE_PANELS", flag)
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=24, block_size=8,
                              layer_loop="unrolled", dtype=jnp.float32)
        runner_params = llm.engine.runner.params
        head = runner_params["embed" if tied else "lm_head"]
        assert ("panels" in runner_params["layer_0"]["o_proj"]) == (flag == "1")
        assert isinstance(head, dict) == (flag == "1")
        runs[flag] = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert llm.engine.block_manager.get_num_free_gpu_blocks() == 24
    for a, b in zip(runs["1"], runs["0"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t] - lb[t]) < 1e-4
