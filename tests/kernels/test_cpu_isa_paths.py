"""The native CPU kernels pick their vector path when they are compiled (``-march=native``), so
one host runs one path. Here the panel matmul (`csrc/dense_matmul_cpu.cc`) and the screened LM
head (`csrc/lm_head_greedy_cpu.cc`) are compiled again for each instruction set this host can
run (portable x86-64, AVX2 + FMA, the host's own: AVX-512 where it has it). The matmul's paths
must agree bit for bit (each output is the same FMA chain over k whatever the register block)
and with float64; every screen must give the float32 logits' first argmax. The library reports
the paths it was built with (`cpu_native.compiled_isa`), which choose whether the LM head is
screened."""

from __future__ import annotations

import ctypes
import platform
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qlinear import to_dense_panels
from pagedjax.worker.model_runner import screened_head_setting
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels need a C++ compiler")


def _cpu_flags() -> set[str]:
    """The host's CPU flags as Linux reports them (none elsewhere)."""
    info = Path("/proc/cpuinfo")
    for line in (info.read_text().splitlines() if info.exists() else []):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _runnable_arches() -> list[str]:
    """-march values whose code this host runs: x86-64 always, x86-64-v3 with AVX2 and FMA
    (and the rest of that level), native (whatever the host has)."""
    flags = _cpu_flags()
    arches = ["x86-64"]
    if {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"} <= flags:
        arches.append("x86-64-v3")
    arches.append("native")
    return arches


def _builds(out: Path, source: str, symbol: str) -> dict[str, str]:
    """{march: FFI target}: ``csrc/<source>`` compiled for each runnable -march, its handler
    ``symbol`` renamed so each build registers as its own target (its other handlers are
    never registered)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the vector paths are x86 ones")
    src = (Path(cpu_native.__file__).with_name("csrc") / source).read_text()
    targets = {}
    for march in _runnable_arches():
        tag = re.sub(r"\W", "_", march)
        name = f"{symbol}_isa_{tag}"
        cc = out / f"{name}.cc"
        cc.write_text(re.sub(rf"\b{symbol}\b", name, src))
        flags = [f for f in cpu_native.FLAGS if not f.startswith("-march")]
        lib = out / f"{name}.so"
        subprocess.run([cpu_native._compiler(), *flags, f"-march={march}",
                        f"-I{jax.ffi.include_dir()}", str(cc), "-o", str(lib)],
                       check=True, capture_output=True)
        handle = ctypes.cdll.LoadLibrary(str(lib))
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(handle, name)),
                                    platform="cpu")
        targets[march] = name
    return targets


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """{march: jitted panel matmul through that build}."""
    fns = {}
    for march, name in _builds(tmp_path_factory.mktemp("mm"), "dense_matmul_cpu.cc",
                               "PagedjaxDenseMatmulCpu").items():
        def mm(x, w, n, target=name):
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))(x, w)

        fns[march] = jax.jit(mm, static_argnums=2)
    return fns


@pytest.fixture(scope="module")
def gated_variants(tmp_path_factory):
    """{march: jitted gate_up matmul with the silu * up epilogue through that build}."""
    fns = {}
    for march, name in _builds(tmp_path_factory.mktemp("gated"), "dense_matmul_cpu.cc",
                               "PagedjaxDenseMatmulSiluMulCpu").items():
        def mm(x, w, n, live, target=name):
            out = jax.ShapeDtypeStruct((x.shape[0], n // 2), x.dtype)
            return jax.ffi.ffi_call(target, out)(x, w, jnp.asarray(live, jnp.int32))

        fns[march] = jax.jit(mm, static_argnums=2)
    return fns


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """{march: jitted screened LM head (greedy tokens) through that build}."""
    fns = {}
    for march, name in _builds(tmp_path_factory.mktemp("head"), "lm_head_greedy_cpu.cc",
                               "PagedjaxLmHeadGreedyCpu").items():
        def head(x, bf16, norms, panels, target=name):
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))(
                x, bf16, norms, panels)

        fns[march] = jax.jit(head)
    return fns


def test_this_host_runs_more_than_the_portable_path(variants):
    """At least the portable and the native build; on any x86 host of the last decade also
    AVX2 + FMA (the AVX2 path is what an AVX2-only host runs)."""
    assert "x86-64" in variants and "native" in variants
    if {"avx2", "fma"} <= _cpu_flags():
        assert "x86-64-v3" in variants


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 13, 64, 65, 130])
@pytest.mark.parametrize("k,n", [(576, 960), (37, 63), (64, 65), (50, 64 * 3 + 17),
                                 (33, 64 * 2 + 40)])
def test_every_vector_path_gives_the_same_bits(variants, m, k, n):
    """Row counts on every register block (1-3 rows: full-width or half passes; 4-7: the
    6-row block and its remainders; 64+: work items, cut between threads), depths off the
    vector width, last panels of 17, 40 and 63 columns (masked stores of a part vector)."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    panels = to_dense_panels(jnp.asarray(w))
    outs = {march: np.asarray(fn(jnp.asarray(x), panels, n)) for march, fn in variants.items()}
    want = x.astype(np.float64) @ w.astype(np.float64)
    tol = 4 * np.sqrt(k) * np.finfo(np.float32).eps * np.abs(x).max() * np.abs(w).max()
    np.testing.assert_allclose(outs["x86-64"], want, atol=tol, rtol=0)
    for march, got in outs.items():
        assert got.shape == (m, n)
        np.testing.assert_array_equal(got, outs["x86-64"], err_msg=march)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 64, 130])
@pytest.mark.parametrize("k,i", [(576, 1536), (37, 64), (100, 192)])
def test_every_vector_path_gives_the_same_gated_bits(gated_variants, m, k, i):
    """silu(gate) * up in the matmul's epilogue: the same bits from the portable, AVX2 and
    native builds (silu is one sequence of rounded operations in each), within a few ulps of
    float64; rows past `live` zeros in each."""
    rng = np.random.default_rng(m * 131 + k + i)
    w = (rng.standard_normal((k, 2 * i)) * 0.2).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :3] *= 30  # gates far out on both tails
    panels = to_dense_panels(jnp.asarray(w))
    live = max(1, m - 1)
    outs = {march: np.asarray(fn(jnp.asarray(x), panels, 2 * i, live))
            for march, fn in gated_variants.items()}
    full = x.astype(np.float64) @ w.astype(np.float64)
    g, u = full[:, :i], full[:, i:]
    want = g / (1 + np.exp(-g)) * u
    want[live:] = 0
    tol = 8 * np.sqrt(k) * np.finfo(np.float32).eps * np.abs(x).max() * np.abs(w).max()
    np.testing.assert_allclose(outs["x86-64"], want, atol=tol * (1 + np.abs(u).max()), rtol=1e-6)
    for march, got in outs.items():
        assert got.shape == (m, i)
        np.testing.assert_array_equal(got, outs["x86-64"], err_msg=march)


def test_the_library_reports_the_paths_of_this_host():
    """-march=native: AVX-512, its BF16 and AVX2 + FMA paths are compiled exactly where the
    host has them."""
    flags = _cpu_flags()
    isa = cpu_native.compiled_isa()
    assert isa <= set(cpu_native.ISA_BITS)
    assert ("avx512f" in isa) == ("avx512f" in flags)
    assert ("avx512bf16" in isa) == ({"avx512f", "avx512_bf16"} <= flags)
    assert ("avx2_fma" in isa) == ({"avx2", "fma"} <= flags)
    assert ("avx512vnni" in isa) == ({"avx512f", "avx512_vnni"} <= flags)


def test_the_lm_head_is_screened_where_a_vector_path_computes_it(monkeypatch):
    """By default only with AVX512-BF16 or AVX2 + FMA (the screen's portable loop is slower
    than the float32 head it replaces); 1 / 0 force it either way."""
    vector = bool({"avx512bf16", "avx2_fma"} & cpu_native.compiled_isa())
    monkeypatch.delenv("PAGEDJAX_SCREENED_HEAD", raising=False)
    assert screened_head_setting() is vector
    for v, want in (("auto", vector), ("1", True), ("on", True), ("0", False),
                    ("false", False)):
        monkeypatch.setenv("PAGEDJAX_SCREENED_HEAD", v)
        assert screened_head_setting() is want, v


def _first_argmax(logits: np.ndarray) -> np.ndarray:
    """Per row: the first NaN, else the first maximum (`greedy_rows_cpu`'s rule)."""
    out = []
    for row in logits:
        nan = np.flatnonzero(np.isnan(row))
        out.append(nan[0] if len(nan) else int(np.argmax(row)))
    return np.asarray(out, np.int32)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(576, 64 * 5 + 17), (37, 200)])
def test_every_screen_path_gives_the_float32_argmax(heads, m, k, n):
    """Each build's tokens are the first argmax of the float32 logits of the panel matmul:
    random rows, a row of exact ties (duplicated columns: the lowest index), a near tie below
    bfloat16's resolution, a zero row (every score 0) and a row with a NaN (not screened)."""
    rng = np.random.default_rng(m * 31 + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, n - 3] = w[:, 7]  # an exact tie with an earlier column
    w[:, n - 1] = w[:, 11] * np.float32(1 + 2**-20)  # a near tie with column 11
    x = rng.standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1] = 0.0
    if m > 2:
        x[2, 3] = np.nan
    if m > 3:  # this row's best columns are the tied pairs
        x[3] = w[:, 7] + w[:, 11] * 1e-3
    panels = np.asarray(to_dense_panels(jnp.asarray(w)))
    screen = cpu_native.lm_head_screen(panels, n, "bf16")
    logits = np.asarray(jax.jit(cpu_native.dense_matmul_cpu, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(panels), n))
    want = _first_argmax(logits)
    for march, fn in heads.items():
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(screen["bf16"]),
                            jnp.asarray(screen["norms"]), jnp.asarray(panels)))
        np.testing.assert_array_equal(got, want, err_msg=march)


@pytest.fixture(scope="module")
def attentions(tmp_path_factory):
    """{march: the native ragged paged attention through that build}."""
    fns = {}
    for march, name in _builds(tmp_path_factory.mktemp("attn"), "paged_attention_cpu.cc",
                               "PagedjaxRaggedPagedAttentionCpu").items():
        def attend(q, k, v, kv_lens, tables, cu, num_seqs, *, scale, target=name):
            i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))(
                q, k, v, i32(kv_lens), i32(tables), i32(cu), i32(num_seqs), i32(2), i32(0),
                jnp.zeros((0,), jnp.float32), scale=np.float32(scale),
                softcap=np.float32(0), data_slots=np.int64(0))

        fns[march] = jax.jit(attend, static_argnames="scale")
    return fns


@pytest.mark.parametrize("seed", range(8))
def test_every_attention_path_matches_float64(attentions, seed):
    """Each build's attention (AVX-512: query heads of a KV head in vectors of sixteen; AVX2:
    in vectors of eight; portable: per-row loops) against float64 numpy on random ragged
    batches (decodes, prefill chunks over cached context, whole prompts, padding rows and
    sequences), the caches' unused blocks and slots poisoned. GQA groups 1-4 take the grouped
    paths, 5 the per-row one; head dims 64 and 128 the compile-time widths, 96 the generic."""
    from tests.kernels.test_cpu_native import _random_batch
    from tests.kernels.test_ragged import np_ragged

    from ._paged import TOL

    dtype = ("float32", "bfloat16")[seed % 2]
    group, head_dim, bs = [(1, 64, 16), (2, 64, 8), (3, 64, 16), (4, 128, 32), (3, 128, 16),
                           (5, 64, 16), (3, 96, 16), (2, 64, 128)][seed]
    seqs, pc, q, cu, kv_lens, tables, pad = _random_batch(100 + seed, dtype, group, head_dim,
                                                          bs)
    scale = head_dim**-0.5
    want = np_ragged(q, pc.k_clean, pc.v_clean, 2, tables, seqs, cu, scale)
    for march, fn in attentions.items():
        got = np.asarray(fn(jnp.asarray(q), jnp.asarray(pc.k_poison), jnp.asarray(pc.v_poison),
                            kv_lens, tables, cu, len(seqs), scale=scale).astype(jnp.float32))
        np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0, err_msg=march)
        if pad:
            np.testing.assert_array_equal(got[-pad:], 0.0, err_msg=march)
