"""paged_decode_attention (Pallas interpret mode and XLA) against a float64 numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode_attention

from ._paged import DTYPES, TOL, dense_kv, make_paged, np_attention

# (batch ctx lens, group, head_dim, block_size, dtype, num_kv_heads). Sampled from the
# cartesian product so each value of each axis appears, including lengths 1, bs - 1, bs,
# bs + 1 and >= 1024, batch 1, and GQA ratios 1/3/4/8.
CASES = [
    ([1], 1, 64, 8, "float32", 2),
    ([7, 8, 9], 3, 64, 8, "bfloat16", 3),
    ([15, 16, 17, 1], 4, 128, 16, "float16", 2),
    ([31, 32, 33], 8, 64, 32, "float32", 1),
    ([1100], 3, 64, 16, "bfloat16", 3),
    ([1030, 5], 4, 128, 32, "float32", 2),
    ([16, 40], 1, 128, 16, "bfloat16", 2),
    ([9, 8, 1, 300], 8, 128, 8, "float16", 1),
    ([17, 33, 64], 3, 128, 32, "float16", 3),
    ([1024], 1, 64, 8, "float32", 1),
    # Pages at or above the KV chunk size: whole-page and sub-page chunks.
    ([70, 300], 4, 64, 64, "bfloat16", 2),
    ([129, 5], 2, 128, 128, "float32", 1),
    ([257, 600], 3, 64, 256, "float16", 1),
]


def _run(case, q, scale, layer, backend, **kw):
    out = paged_decode_attention(
        jnp.asarray(q), jnp.asarray(case[0]), jnp.asarray(case[1]),
        jnp.asarray(case[2]), jnp.asarray(case[3]), scale=scale, layer=layer,
        backend=backend, **kw,
    )
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_decode_matches_reference_and_ignores_poison(idx, backend):
    lens, group, head_dim, bs, dtype, hkv = CASES[idx]
    rng = np.random.default_rng(1000 + idx)
    pc = make_paged(rng, ctx_lens=lens, num_layers=2, num_kv_heads=hkv, block_size=bs,
                    head_dim=head_dim, dtype=dtype, share_prefix=len(lens) > 1)
    q = rng.standard_normal((len(lens), hkv * group, head_dim)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, DTYPES[dtype]))
    scale = head_dim**-0.5
    layer = 1
    expect = np.stack([
        np_attention(q[s], dense_kv(pc.k_clean, layer, pc.block_tables[s], c),
                     dense_kv(pc.v_clean, layer, pc.block_tables[s], c), scale)
        for s, c in enumerate(lens)
    ])
    clean = _run((pc.k_clean, pc.v_clean, pc.block_tables, pc.ctx_lens), q, scale, layer,
                 backend)
    poisoned = _run((pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens), q, scale,
                    layer, backend)
    np.testing.assert_allclose(clean, expect, atol=TOL[dtype], rtol=0)
    # Unused blocks and tail slots never influence the result: bit-identical output.
    np.testing.assert_array_equal(poisoned, clean)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_counts_agree(num_splits):
    rng = np.random.default_rng(7)
    pc = make_paged(rng, ctx_lens=[300, 1, 64, 129], num_layers=1, num_kv_heads=2,
                    block_size=16, head_dim=64, dtype="float32")
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    args = (pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens)
    ref = _run(args, q, 0.125, 0, "xla")
    out = _run(args, q, 0.125, 0, "pallas", num_splits=num_splits)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("block_size,chunk_tokens", [(8, 16), (32, 16), (32, 128), (64, 32)])
def test_chunk_sizes_agree(block_size, chunk_tokens):
    """Several pages per chunk, a slice of a page per chunk, and everything between give
    the same attention (the tuning table may pick any of them)."""
    rng = np.random.default_rng(17)
    pc = make_paged(rng, ctx_lens=[300, 1, 64, 129], num_layers=1, num_kv_heads=2,
                    block_size=block_size, head_dim=64, dtype="float32")
    q = rng.standard_normal((4, 6, 64)).astype(np.float32)
    args = (pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens)
    ref = _run(args, q, 0.125, 0, "xla")
    out = _run(args, q, 0.125, 0, "pallas", chunk_tokens=chunk_tokens, num_splits=3)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
def test_padding_rows_are_zero(backend):
    rng = np.random.default_rng(3)
    pc = make_paged(rng, ctx_lens=[0, 20, 0], num_layers=1, num_kv_heads=1, block_size=8,
                    head_dim=64, dtype="bfloat16")
    q = rng.standard_normal((3, 3, 64)).astype(np.float32)
    out = _run((pc.k_poison, pc.v_poison, pc.block_tables, pc.ctx_lens),
               np.asarray(jnp.asarray(q, jnp.bfloat16)), 0.125, 0, backend)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[[0, 2]], 0.0)
    assert np.abs(out[1]).sum() > 0


@pytest.mark.parametrize("backend", ["pallas", "xla", "cpu"])
def test_traced_layer_in_scan_and_4d_cache(backend):
    """Inside lax.scan over layers (traced layer index) == per-layer 4-D calls."""
    rng = np.random.default_rng(11)
    pc = make_paged(rng, ctx_lens=[5, 40], num_layers=3, num_kv_heads=2, block_size=8,
                    head_dim=64, dtype="float32")
    q = jnp.asarray(rng.standard_normal((2, 6, 64)), jnp.float32)
    k, v = jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison)
    bt, lens = jnp.asarray(pc.block_tables), jnp.asarray(pc.ctx_lens)

    @jax.jit
    def scanned(q, k, v):
        def step(carry, layer):
            out = paged_decode_attention(q, k, v, bt, lens, scale=0.125, layer=layer,
                                         backend=backend)
            return carry, out
        return jax.lax.scan(step, 0, jnp.arange(3, dtype=jnp.int32))[1]

    got = np.asarray(scanned(q, k, v))
    for layer in range(3):
        one = paged_decode_attention(q, k[layer], v[layer], bt, lens, scale=0.125,
                                     backend=backend)
        np.testing.assert_array_equal(got[layer], np.asarray(one))


def test_backend_env_override(monkeypatch):
    from pallas_kernels import resolve_backend

    monkeypatch.delenv("PAGEDJAX_ATTENTION_BACKEND", raising=False)
    # The platform's default: the native kernel on a CPU host (it builds here), Pallas on a GPU.
    assert resolve_backend(None) == ("pallas" if jax.default_backend() in ("gpu", "cuda") else "cpu")
    monkeypatch.setenv("PAGEDJAX_ATTENTION_BACKEND", "pallas")
    assert resolve_backend(None) == "pallas"
    assert resolve_backend("xla") == "xla"
    with pytest.raises(ValueError):
        resolve_backend("cudnn")


def test_cpu_backend_on_a_gpu_target_is_refused_by_name():
    """The native kernel is an XLA:CPU custom call; asked for on a GPU it must say so."""
    from pallas_kernels import resolve_backend

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(ValueError, match="backend 'cpu'.*lowers for 'cuda'.*'pallas' or 'xla'"):
            resolve_backend("cpu")
        assert resolve_backend(None) == "pallas"


def test_pallas_lowering_env(monkeypatch):
    from pallas_kernels.backend import ENV_INTERPRET, ENV_LOWERING, pallas_lowering

    monkeypatch.delenv(ENV_LOWERING, raising=False)
    monkeypatch.setenv(ENV_INTERPRET, "1")
    assert pallas_lowering() == "triton"  # "auto" when kernels interpret: Triton
    monkeypatch.delenv(ENV_INTERPRET)
    for forced in ("triton", "mosaic", "MOSAIC"):
        monkeypatch.setenv(ENV_LOWERING, forced)
        assert pallas_lowering() == forced.lower()
    monkeypatch.setenv(ENV_LOWERING, "cutlass")
    with pytest.raises(ValueError, match=ENV_LOWERING):
        pallas_lowering()


def test_auto_lowering_is_mosaic_only_on_a_known_hopper(monkeypatch):
    """The default: Mosaic where the GPU says it is a Hopper and jax has the kernels' API;
    Triton on Ampere / Ada / Blackwell, on a target that does not say (deviceless AOT), and
    whenever the kernels interpret."""
    from pallas_kernels import backend
    from pallas_kernels.backend import ENV_INTERPRET, ENV_LOWERING, auto_lowering

    assert auto_lowering("9.0", True) == "mosaic"
    for cc in ("8.0", "8.9", "10.0", "12.0", None):
        assert auto_lowering(cc, True) == "triton", cc
    assert auto_lowering("9.0", False) == "triton"
    # Through pallas_lowering: a GPU target that says 9.0, compiled, picks Mosaic ...
    monkeypatch.delenv(ENV_LOWERING, raising=False)
    monkeypatch.setattr(backend, "is_gpu_target", lambda: True)
    monkeypatch.setattr(backend, "target_compute_capability", lambda: "9.0")
    monkeypatch.setenv(ENV_INTERPRET, "0")
    from pallas_kernels.mosaic_decode_attention import mosaic_available

    assert backend.pallas_lowering() == ("mosaic" if mosaic_available() else "triton")
    # ... the env still wins, and interpreting keeps Triton.
    monkeypatch.setenv(ENV_LOWERING, "triton")
    assert backend.pallas_lowering() == "triton"
    monkeypatch.delenv(ENV_LOWERING)
    monkeypatch.setenv(ENV_INTERPRET, "1")
    assert backend.pallas_lowering() == "triton"


def test_tuning_table_lookup():
    """Every architecture answers every shape class; the measured-file override wins."""
    from pallas_kernels import tuning

    for arch in tuning.TABLE:
        for kernel in ("decode", "ragged"):
            for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
                for d in (64, 96, 128, 256):
                    t = tuning.lookup(kernel, dtype, d, arch)
                    assert t.chunk_tokens in (16, 32, 64, 128) and t.num_warps in (4, 8)
                    assert (t.q_rows > 0) == (kernel == "ragged")
    assert tuning.arch_of("NVIDIA H100 80GB HBM3") == "sm90"
    assert tuning.arch_of("NVIDIA A100-SXM4-80GB") == "sm80"
    assert tuning.arch_of("NVIDIA B200") == "sm100"
    assert tuning.arch_of("cpu") == "generic"


def test_tuning_file_overrides_table(tmp_path, monkeypatch):
    import json

    from pallas_kernels import tuning

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps([dict(arch="sm90", kernel="decode", itemsize=2, head_dim=128,
                                     num_warps=8, num_stages=4, chunk_tokens=32)]))
    monkeypatch.setenv(tuning.ENV_TUNING_FILE, str(path))
    assert tuning.lookup("decode", jnp.bfloat16, 128, "sm90") == tuning.KernelTuning(8, 4, 32)
    assert tuning.lookup("decode", jnp.float32, 128, "sm90") == tuning.TABLE["sm90"][
        ("decode", 4, 128)]


@pytest.mark.parametrize("splits", [1, 3, 64, 65, 130])
def test_split_merge_matches_float64_either_way(splits):
    """`combine_splits` unrolls up to UNROLLED_MERGE_MAX_SPLITS splits (one fusion on a GPU)
    and reduces beyond (a batch-1 decode with few KV heads and a long context runs up to 264
    splits); both equal a float64 merge, and a row no split saw (every m at the kernel's mask
    value, every sum 0) comes out 0."""
    from pallas_kernels._common import MASK_VALUE
    from pallas_kernels.paged_decode_attention import UNROLLED_MERGE_MAX_SPLITS, combine_splits

    assert UNROLLED_MERGE_MAX_SPLITS == 64  # the cases straddle it
    rng = np.random.default_rng(splits)
    acc = rng.standard_normal((splits, 2, 3, 16, 8)).astype(np.float32)
    m = (rng.standard_normal((splits, 2, 3, 16)) * 20).astype(np.float32)
    lsum = rng.uniform(0.5, 4, (splits, 2, 3, 16)).astype(np.float32)
    # Splits past a short context saw nothing; row (1, 2, 5) saw nothing at all.
    m[splits // 2 + 1:, 0, 1] = MASK_VALUE
    lsum[splits // 2 + 1:, 0, 1] = 0
    acc[splits // 2 + 1:, 0, 1] = 0
    m[:, 1, 2, 5], lsum[:, 1, 2, 5], acc[:, 1, 2, 5] = MASK_VALUE, 0, 0
    out = np.asarray(combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(lsum), rows=12))
    a, mm, ls = (x.astype(np.float64)[:, :, :, :12] for x in (acc, m, lsum))
    w = np.exp(mm - mm.max(0))
    den = (w * ls).sum(0)
    want = np.where(den[..., None] > 0, (w[..., None] * a).sum(0)
                    / np.where(den > 0, den, 1)[..., None], 0)
    assert out.shape == (2, 3, 12, 8)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)
    assert not out[1, 2, 5].any()
