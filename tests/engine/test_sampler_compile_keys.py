"""`sample` is compiled once per sampler batch bucket, whatever the step's logits rows: warm-up
asks for it only on ``[b, V]`` logits (the rows gathered first by `take_rows` where a step's
logits have other rows), and serving hands it the same shapes (`LLMEngine._sampler_rows`). Per
(logits rows, batch) pair, warm-up at max_num_seqs 256 compiled 159 `sample` executables, ~52 000
memory mappings on CPU, and with the steps' it passed Linux's default limit, where XLA aborts
the process (`worker.compile_stats.memory_maps`)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedjax.engine as engine_mod
from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM
from pagedjax.engine import LLMEngine, _identity_rows
from pagedjax.worker.compile_stats import memory_maps
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def engine():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 256})
    params = assemble_params(config, random_hf_tensors(config, seed=3).get)
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                          max_num_seqs=64, max_num_batched_tokens=256, max_model_len=256,
                          warmup=False)
    return llm.engine


def test_warm_up_samples_once_per_batch_bucket(engine, monkeypatch):
    """The warm-up plan's `sample` calls: logits of ``b`` rows for a batch of ``b``, every
    sampler batch the steps reach, each (batch, variant) once; gathers for the other pairs."""
    calls, gathers = [], []
    monkeypatch.setattr(engine_mod, "sample",
                        lambda logits, meta, num_logprobs=0, rows=None, native=False, chunked=False:
                        calls.append((logits.shape[0], len(rows))))
    monkeypatch.setattr(engine_mod, "take_rows",
                        lambda logits, rows: gathers.append((logits.shape[0], len(rows))))
    shapes = engine.runner.shape_plan.step_shapes(True)
    for _, thunk in engine._warmup_sampler_calls(shapes):
        thunk()
    assert calls and all(r == b for r, b in calls)
    want = set()
    plan = engine.runner.shape_plan
    for _t, s, _m, r, _d in shapes:
        for b in {engine._sample_batch(1, s), plan.seq_cap}:
            want.add(b)
            if r != b:
                assert (r, b) in gathers
    assert {b for _, b in calls} == want
    # plain and penalised; histories packed on the host add the merged-on-device variant
    # under async scheduling, histories gathered on the device have only that one
    if engine.history_slots is not None:
        variants = 2
    else:
        variants = 3 if engine.runner.feed_tokens else 2
    assert len(calls) == variants * len(want)  # not per step shape
    assert len(shapes) > len(want)


def test_sampler_rows_gathers_only_other_shapes():
    rng = np.random.default_rng(0)
    logits = engine_mod.jnp.asarray(rng.standard_normal((5, 11)).astype(np.float32))
    same = np.array([4, 0, 0, 1, 2], np.int32)
    x, rows = LLMEngine._sampler_rows(logits, same)
    assert x is logits and rows is same
    for src in (np.array([3, 3, 1], np.int32), np.array([0, 1, 2, 3, 4, 4, 0, 2], np.int32)):
        x, rows = LLMEngine._sampler_rows(logits, src)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(logits)[src])
        np.testing.assert_array_equal(rows, np.arange(len(src)))
        assert rows is _identity_rows(len(src)) and not rows.flags.writeable


def test_memory_maps_counts_this_process():
    maps = memory_maps()
    if maps is None:
        pytest.skip("no /proc/self/maps on this platform")
    used, limit = maps
    lines = sum(1 for _ in open("/proc/self/maps"))
    assert 0 < used and abs(used - lines) < 50 and limit >= 1024


def test_warm_up_warns_near_the_mapping_limit(monkeypatch, caplog):
    """Past `MAX_MAP_SHARE` of the limit the warning names the sysctl; below it, silence."""
    monkeypatch.setattr(engine_mod, "memory_maps", lambda: (81, 100))
    with caplog.at_level("WARNING", logger="pagedjax.engine"):
        assert engine_mod._warn_near_map_limit()
    assert "vm.max_map_count=100" in caplog.text and "sysctl" in caplog.text
    caplog.clear()
    for maps in ((80, 100), None):
        monkeypatch.setattr(engine_mod, "memory_maps", lambda m=maps: m)
        with caplog.at_level("WARNING", logger="pagedjax.engine"):
            assert not engine_mod._warn_near_map_limit()
    assert not caplog.text
