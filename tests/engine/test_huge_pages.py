"""`worker/huge_pages.py`: a CPU runner's weights copied into one mapping advised for
transparent huge pages and read in place by JAX, values unchanged; off by switch, for
multi-device trees and where the kernel has no THP."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pagedjax.worker import huge_pages
from pagedjax.worker.huge_pages import HUGE_PAGE, on_huge_pages, place_on_huge_pages, thp_available


def _tree(rng):
    cpu = jax.devices("cpu")[0]
    return jax.device_put({
        "a": rng.standard_normal((300, 577)).astype(np.float32),
        "b": {"c": rng.standard_normal((3,)).astype(ml_dtypes.bfloat16),
              "d": rng.integers(-128, 127, (64, 64, 5)).astype(np.int8),
              "e": np.float32(3.5), "f": np.zeros((0, 4), np.float32)},
        "g": [rng.standard_normal((1 << 19,)).astype(np.float32)]}, cpu)


def _mappings():
    """(first byte, end, entry) of each mapping in /proc/self/smaps."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        yield lo, hi, entry


def _vma_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping that holds ``address``."""
    for lo, hi, entry in _mappings():
        if lo <= address < hi:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_bytes(x) -> int:
    """Bytes of 2 MiB pages (smaps AnonHugePages) in the mappings that hold ``x``'s buffer."""
    lo = x.unsafe_buffer_pointer()
    hi = lo + x.nbytes
    return sum(int(re.search(r"AnonHugePages:\s+(\d+) kB", entry).group(1)) << 10
               for a, b, entry in _mappings() if a < hi and lo < b)


def _interior_advised(x) -> bool:
    """Every mapping over ``x``'s whole 2 MiB pages carries the MADV_HUGEPAGE advice (smaps
    flag ``hg``): what `zeros_on_huge_pages` does, whatever the kernel then manages to give."""
    lo = -(-x.unsafe_buffer_pointer() // HUGE_PAGE) * HUGE_PAGE
    hi = (x.unsafe_buffer_pointer() + x.nbytes) // HUGE_PAGE * HUGE_PAGE
    over = [entry for a, b, entry in _mappings() if a < hi and lo < b]
    return hi > lo and bool(over) and all(
        "hg" in re.search(r"VmFlags:(.*)", entry).group(1).split() for entry in over)


def _eligible(x) -> bool:
    return bool(re.search(r"THPeligible:\s+1", _vma_of(x.unsafe_buffer_pointer())))


@pytest.mark.skipif(not thp_available(), reason="this kernel offers no transparent huge pages")
def test_leaves_alias_one_huge_page_mapping_with_values_unchanged(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    tree = _tree(np.random.default_rng(0))
    want = jax.tree.map(np.asarray, tree)
    placed = place_on_huge_pages(tree)
    leaves = jax.tree.leaves(placed)
    assert jax.tree.structure(placed) == jax.tree.structure(tree)
    for got, ref in zip(leaves, jax.tree.leaves(want)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(got), ref)
        assert got.committed and got.devices() == {jax.devices("cpu")[0]}
    ptrs = [x.unsafe_buffer_pointer() for x in leaves if x.size]
    assert min(ptrs) % HUGE_PAGE == 0  # the first leaf starts a huge page
    entry = _vma_of(ptrs[0])
    assert all(_vma_of(p) == entry for p in ptrs)  # one mapping holds them all
    assert re.search(r"THPeligible:\s+1", entry)  # advised: faults take 2 MiB pages
    assert on_huge_pages(placed) and not on_huge_pages(tree)
    # The arrays stay valid once everything else that referenced the mapping is gone.
    del tree, leaves
    import gc

    gc.collect()
    out = jax.jit(lambda t: t["a"].sum() + t["g"][0].sum())(placed)
    np.testing.assert_allclose(float(out), want["a"].sum(dtype=np.float64)
                               + want["g"][0].sum(dtype=np.float64), rtol=1e-4)


def test_switch_off_and_trees_it_leaves_alone(monkeypatch):
    tree = _tree(np.random.default_rng(1))
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert place_on_huge_pages(tree) is tree
    monkeypatch.delenv(huge_pages.ENV)
    monkeypatch.setattr(huge_pages, "thp_available", lambda: False)
    assert place_on_huge_pages(tree) is tree
    monkeypatch.setattr(huge_pages, "thp_available", lambda: True)
    with_numpy = {"a": np.ones(3, np.float32), "b": jnp.ones(3)}
    assert place_on_huge_pages(with_numpy) is with_numpy  # not all device arrays
    assert place_on_huge_pages({}) == {}


def test_a_client_that_copies_keeps_the_original_arrays(monkeypatch):
    """If device_put copied instead of aliasing, the mapping would only waste memory."""
    if not thp_available():
        monkeypatch.setattr(huge_pages, "thp_available", lambda: True)
    tree = _tree(np.random.default_rng(2))
    real_put = jax.device_put
    monkeypatch.setattr(huge_pages.jax, "device_put",
                        lambda x, d=None: real_put(np.array(x), d))  # a fresh (copied) buffer
    assert place_on_huge_pages(tree) is tree


@pytest.mark.skipif(not thp_available(), reason="this kernel offers no transparent huge pages")
def test_a_cpu_engine_reads_its_weights_from_huge_pages_and_swapped_ones_too(monkeypatch):
    """The runner's params (and those of a weight swap) live in advised mappings, and the
    engine's greedy tokens equal those of an engine whose weights stay on 4 KiB pages."""
    from pagedjax import SamplingParams
    from tests.serving.fuzz_support import assert_pool_whole, tiny_engine

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    eng = tiny_engine(layer_loop="unrolled")
    assert on_huge_pages(eng.runner.params)
    assert all(_eligible(x) for x in jax.tree.leaves(eng.runner.params))
    monkeypatch.setenv(huge_pages.ENV, "0")
    plain = tiny_engine(layer_loop="unrolled")
    # Not by smaps flags: THP mode `always` (the CI host's) makes malloc's memory eligible too,
    # and numpy advises its own large buffers, which can merge into [heap].
    assert not any(on_huge_pages(x) for x in jax.tree.leaves(plain.runner.params))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for e in (eng, plain):
        e.add_request("r", None, sp, prompt_token_ids=[3, 1, 4, 1, 5, 9, 2, 6])
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    outs.append(o.outputs[0].token_ids)
    assert len(outs) == 2 and list(outs[0]) == list(outs[1])
    assert_pool_whole(eng)
    assert_pool_whole(plain)
    monkeypatch.delenv(huge_pages.ENV)
    swapped = eng.runner.place_params(_checkpoint_params())
    assert on_huge_pages(swapped) and all(_eligible(x) for x in jax.tree.leaves(swapped))


def _checkpoint_params():
    from models.config import ModelConfig
    from models.weights import assemble_params
    from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors

    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    return assemble_params(config, random_hf_tensors(config, seed=6).get)


@pytest.mark.skipif(not thp_available(), reason="this kernel offers no transparent huge pages")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_kv_cache_zeros_on_huge_pages(dtype):
    """`zeros_on_huge_pages`: zeros of the shape and dtype asked, committed to the CPU
    device, in XLA's own buffer (so a donating step keeps it in place) whose whole 2 MiB
    pages are huge pages."""
    from pallas_kernels.cpu_native import zeros_on_huge_pages

    shape = (2, 3, 700, 16, 64)  # ~4.3 MB at fp32: at least one whole aligned 2 MiB page
    x = zeros_on_huge_pages(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.committed
    assert x.devices() == {jax.devices("cpu")[0]}
    assert not np.asarray(x.astype(jnp.float32)).any()
    # Advised, and backed by huge pages (how many depends on what the kernel can find: on a
    # quiet host all of them, here and in CI; at least one proves the advice took effect).
    assert _interior_advised(x) and _huge_bytes(x) > 0
    before = x.unsafe_buffer_pointer()
    y = jax.jit(lambda c: c.at[1, 2, 3].set(1), donate_argnums=0)(x)
    assert y.unsafe_buffer_pointer() == before and _interior_advised(y) and _huge_bytes(y) > 0


@pytest.mark.skipif(not thp_available(), reason="this kernel offers no transparent huge pages")
def test_an_engines_kv_cache_stays_on_huge_pages_through_steps_and_swaps(monkeypatch):
    """The CPU engine's K and V caches start on 2 MiB pages and keep their buffers through
    steps with prefix-cache hits, block copies and swaps out and in (each donates the caches
    and writes in place), so the attention reads huge pages for the engine's life."""
    from pagedjax import SamplingParams
    from tests.serving.fuzz_support import assert_pool_whole, tiny_engine

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    eng = tiny_engine(layer_loop="unrolled", num_gpu_blocks=4096, enable_prefix_caching=True)
    r = eng.runner
    ptrs = (r.k_cache.unsafe_buffer_pointer(), r.v_cache.unsafe_buffer_pointer())
    assert r.k_cache.nbytes >= 4 * HUGE_PAGE
    assert all(_interior_advised(c) and _huge_bytes(c) > 0 for c in (r.k_cache, r.v_cache))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        eng.add_request(str(i), None, sp, prompt_token_ids=list(range(3, 20)) + [50 + i] * i)
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_whole(eng)
    r.copy_blocks([(1, 2), (3, 4)])
    r.swap_out([(5, 0), (6, 1)])
    r.swap_in([(0, 7), (1, 8)])
    np.testing.assert_array_equal(np.asarray(r.k_cache[:, :, 7]), np.asarray(r.k_cache[:, :, 5]))
    assert (r.k_cache.unsafe_buffer_pointer(), r.v_cache.unsafe_buffer_pointer()) == ptrs
    assert all(_interior_advised(c) and _huge_bytes(c) > 0 for c in (r.k_cache, r.v_cache))
