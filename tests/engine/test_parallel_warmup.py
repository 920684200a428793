"""Warm-up's compilations side by side (`pagedjax.worker.parallel_warmup`): the byte budget
and error rules of `run_bounded`, the thread setting, and that the runner's ahead-of-time
step compilations are the executables its warm-up steps then run (no step compiles twice)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.worker import parallel_warmup
from pagedjax.worker.compile_stats import num_backend_compiles
from pagedjax.worker.parallel_warmup import run_bounded, warmup_threads
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


class _Probe:
    """Thunks that record how many bytes were in flight while each ran."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight = self.peak = 0
        self.order: list[int] = []

    def call(self, i: int, size: int, fail: bool = False):
        def thunk():
            with self.lock:
                self.inflight += size
                self.peak = max(self.peak, self.inflight)
                self.order.append(i)
            time.sleep(0.002)
            with self.lock:
                self.inflight -= size
            if fail:
                raise RuntimeError(f"call {i} failed")
            return i
        return size, thunk


@pytest.mark.parametrize("seed", range(4))
def test_run_bounded_respects_the_byte_budget(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(0, 100, 40)]
    budget = int(rng.integers(100, 250))
    probe = _Probe()
    with cf.ThreadPoolExecutor(8) as pool:
        n = run_bounded(pool, (probe.call(i, s) for i, s in enumerate(sizes)), budget)
    assert n == len(sizes)
    assert sorted(probe.order) == list(range(len(sizes)))
    assert 0 < probe.peak <= budget


def test_run_bounded_runs_an_oversized_call_alone():
    probe = _Probe()
    with cf.ThreadPoolExecutor(4) as pool:
        run_bounded(pool, [probe.call(0, 10), probe.call(1, 500), probe.call(2, 10)], 100)
    assert probe.peak == 500  # the big call had the pool to itself


def test_run_bounded_raises_the_first_error_and_stops_drawing():
    probe = _Probe()
    drawn = []

    def calls():
        for i in range(50):
            drawn.append(i)
            yield probe.call(i, 60, fail=(i == 3))

    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="call 3 failed"):
        run_bounded(pool, calls(), 100)  # at most one 60-byte call in flight
    assert len(drawn) < 50
    assert probe.inflight == 0  # nothing left running


def test_run_bounded_rejects_negative_sizes():
    with cf.ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match="max_bytes"):
            run_bounded(pool, [], -1)
        with pytest.raises(ValueError, match="bytes"):
            run_bounded(pool, [(-5, lambda: None)], 10)


def test_warmup_threads_setting(monkeypatch):
    monkeypatch.setenv(parallel_warmup.ENV_THREADS, "3")
    assert warmup_threads() == 3
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(parallel_warmup.ENV_THREADS, bad)
        with pytest.raises(ValueError, match=parallel_warmup.ENV_THREADS):
            warmup_threads()
    monkeypatch.delenv(parallel_warmup.ENV_THREADS)
    assert 1 <= warmup_threads() <= parallel_warmup.MAX_DEFAULT_THREADS


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=7).get)


def test_steps_compiled_ahead_are_the_ones_warmup_runs(tiny):
    """With a pool, every warm-up step runs an executable compiled ahead of time: the runs
    themselves compile nothing, and the KV cache is untouched (the dummy steps write nowhere)."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=24, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          swap_space_gb=0, warmup=False)
    runner = llm.engine.runner
    before_k = np.asarray(runner.k_cache).copy()
    compiles_in_runs = []
    run = runner.execute

    def counted(inputs):
        c = num_backend_compiles()
        out = run(inputs)
        compiles_in_runs.append(num_backend_compiles() - c)
        return out

    runner.execute = counted
    with cf.ThreadPoolExecutor(2) as pool:
        shapes = runner.warmup(prompt_logprobs=True, pool=pool)
    assert len(compiles_in_runs) == len(shapes) > 4
    assert compiles_in_runs == [0] * len(shapes)
    np.testing.assert_array_equal(np.asarray(runner.k_cache), before_k)


def test_a_failing_parallel_warmup_falls_back_to_one_at_a_time(tiny, monkeypatch, caplog):
    """A failure in the side-by-side part (stood in for by `run_bounded` raising) is logged
    and warm-up redone one call at a time: every step shape is compiled and serving then
    compiles nothing."""
    import pagedjax.engine as engine_mod

    def broken(*_a, **_k):
        raise RuntimeError("stand-in for a concurrent compilation failure")

    monkeypatch.setattr(engine_mod, "run_bounded", broken)
    monkeypatch.setenv(parallel_warmup.ENV_THREADS, "2")
    config, params = tiny
    with caplog.at_level("WARNING", logger="pagedjax.engine"):
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=24, block_size=8,
                              max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                              swap_space_gb=0, warmup=True)
    assert "parallel warm-up failed" in caplog.text
    engine = llm.engine
    shapes = engine.runner.shape_plan.step_shapes(True)
    assert {tuple(s) for s in shapes} <= set(engine.runner.compiled_shapes)
    before = num_backend_compiles()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert num_backend_compiles() == before
