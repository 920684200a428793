"""The native XLA:CPU attention kernel (`pallas_kernels/cpu_native.py`) on its own terms.

The shared sweeps in test_decode.py / test_ragged.py run it as backend "cpu" against float64
numpy with poisoned blocks; this module covers what is specific to it: random ragged batches
whose tiles cross the kernel's 16-token tile and fan out over its thread pool, bf16 rounding,
the dtype fallback, the build cache, and the switch that turns it off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_native, ragged_paged_attention

from ._paged import TOL, make_paged
from .test_ragged import np_ragged

# Only a machine without a C++ compiler skips; one with a compiler fails if the build does.
pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C++ compiler")


def _random_batch(seed: int, dtype: str, group: int, head_dim: int, bs: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    seqs = []
    for _ in range(n):
        kind = rng.integers(3)
        if kind == 0:  # decode row
            kv = int(rng.integers(1, 400))
            seqs.append((1, kv))
        elif kind == 1:  # chunk of a prefill with cached prefix
            q = int(rng.integers(2, 70))
            seqs.append((q, q + int(rng.integers(1, 200))))
        else:  # whole prompt
            q = int(rng.integers(1, 90))
            seqs.append((q, q))
    hkv = int(rng.integers(1, 4))
    pc = make_paged(rng, ctx_lens=[kv for _, kv in seqs], num_layers=3, num_kv_heads=hkv,
                    block_size=bs, head_dim=head_dim, dtype=dtype, share_prefix=n > 1)
    q_lens = [q for q, _ in seqs]
    pad_tokens, pad_seqs = int(rng.integers(0, 9)), int(rng.integers(0, 3))
    cu = np.zeros(n + pad_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.concatenate([pc.ctx_lens, rng.integers(1, 500, pad_seqs)]).astype(np.int32)
    tables = np.concatenate(
        [pc.block_tables, rng.integers(-5, 10_000, (pad_seqs, pc.block_tables.shape[1]))]
    ).astype(np.int32)
    q = rng.standard_normal((sum(q_lens) + pad_tokens, hkv * group, head_dim)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, jnp.dtype(dtype)))
    return seqs, pc, q, cu, kv_lens, tables, pad_tokens


@pytest.mark.parametrize("seed", range(12))
def test_random_ragged_batches_match_float64(seed):
    # Head dims 64 and 128 run the kernel's compile-time-width variants, 96 and 256 the
    # generic one.
    dtype = ("float32", "bfloat16")[seed % 2]
    group, head_dim, bs = [(1, 64, 16), (3, 64, 8), (4, 128, 32), (2, 64, 128), (3, 96, 16),
                           (2, 256, 16)][seed % 6]
    seqs, pc, q, cu, kv_lens, tables, pad = _random_batch(seed, dtype, group, head_dim, bs)
    scale = head_dim**-0.5
    expect = np_ragged(q, pc.k_clean, pc.v_clean, 2, tables, seqs, cu, scale)
    out = ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison),
        jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs)),
        scale=scale, layer=2, backend="cpu")
    out = np.asarray(out.astype(jnp.float32))
    # fp32 softmax and accumulation: bf16 error is the output rounding plus bf16 inputs.
    np.testing.assert_allclose(out, expect, atol=TOL[dtype], rtol=0)
    if pad:
        np.testing.assert_array_equal(out[-pad:], 0.0)
    assert np.isfinite(out).all()


def test_traced_layer_under_scan_matches_per_layer_calls():
    seqs, pc, q, cu, kv_lens, tables, _ = _random_batch(3, "float32", 3, 64, 8)
    k, v = jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison)
    args = (jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(seqs)))

    @jax.jit
    def scanned(q):
        def body(c, layer):
            return c, ragged_paged_attention(q, k, v, *args, scale=0.1, layer=layer,
                                             backend="cpu")
        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    got = np.asarray(scanned(jnp.asarray(q)))
    for layer in range(3):
        one = ragged_paged_attention(jnp.asarray(q), k, v, *args, scale=0.1, layer=layer,
                                     backend="cpu")
        np.testing.assert_array_equal(got[layer], np.asarray(one))


@pytest.mark.parametrize("group,head_dim,bs", [(2, 64, 16), (3, 64, 8), (4, 128, 32)])
def test_a_query_head_scores_the_same_with_or_without_its_group(group, head_dim, bs):
    """The kernel runs the query heads of one KV head together (one pass over V for the
    group); each head's output is bit-identical to the same head attended on its own
    (a group of one), prompts and decodes, fp32 and bf16."""
    for seed, dtype in ((11, "float32"), (12, "bfloat16")):
        seqs, pc, q, cu, kv_lens, tables, _ = _random_batch(seed, dtype, group, head_dim, bs)
        k, v = jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison)
        args = (jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
                jnp.int32(len(seqs)))
        whole = np.asarray(ragged_paged_attention(jnp.asarray(q), k, v, *args, scale=0.1,
                                                  layer=1, backend="cpu").astype(jnp.float32))
        for g in range(group):
            alone = ragged_paged_attention(jnp.asarray(q[:, g::group]), k, v, *args,
                                           scale=0.1, layer=1, backend="cpu")
            np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)),
                                          whole[:, g::group])


def test_float16_falls_back_to_the_xla_path():
    """No native float16 variant: backend "cpu" gives exactly the XLA reference's result."""
    seqs, pc, q, cu, kv_lens, tables, _ = _random_batch(5, "float16", 2, 64, 16)
    args = [jnp.asarray(a) for a in (q, pc.k_poison, pc.v_poison, kv_lens, tables, cu)]
    cpu = ragged_paged_attention(*args, jnp.int32(len(seqs)), scale=0.1, layer=0, backend="cpu")
    xla = ragged_paged_attention(*args, jnp.int32(len(seqs)), scale=0.1, layer=0, backend="xla")
    np.testing.assert_array_equal(np.asarray(cpu), np.asarray(xla))


def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_CACHE, str(tmp_path))
    path = cpu_native.build()
    assert path.is_relative_to(tmp_path) and path.stat().st_size > 0
    mtime = path.stat().st_mtime_ns
    assert cpu_native.build() == path and path.stat().st_mtime_ns == mtime  # not rebuilt


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_CACHE, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_native.NativeBuildError, match="no-such-compiler"):
        cpu_native.build()


def test_switch_off_selects_xla(monkeypatch):
    from pallas_kernels import resolve_backend

    monkeypatch.delenv("PAGEDJAX_ATTENTION_BACKEND", raising=False)
    cpu_native.available.cache_clear()
    try:
        monkeypatch.setenv(cpu_native.ENV_DISABLE, "0")
        assert resolve_backend(None) == "xla"
        with pytest.raises(ValueError, match="native CPU kernel is unavailable"):
            resolve_backend("cpu")
    finally:
        cpu_native.available.cache_clear()
    monkeypatch.delenv(cpu_native.ENV_DISABLE)
    assert resolve_backend(None) == "cpu"


def test_loading_keeps_subnormal_floats():
    """The library must not switch the process to flush-to-zero (as -ffast-math's
    crtfastmath.o does on load): numpy, hypothesis and user code rely on IEEE subnormals."""
    import ctypes

    ctypes.cdll.LoadLibrary(str(cpu_native.build()))
    tiny = float(np.finfo(np.float64).smallest_subnormal)
    assert tiny * 1.0 > 0.0
    assert np.float32(np.finfo(np.float32).smallest_subnormal) * np.float32(1) > 0
