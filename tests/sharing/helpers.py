"""Shared helpers for the memory-sharing end-to-end tests."""

from __future__ import annotations

import numpy as np

from pagedjax import LLM


def assert_pool_whole(llm: LLM) -> None:
    """No request left, no leaked or pinned block: every GPU block is free again."""
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == llm.engine.runner.num_gpu_blocks


def run_to_completion(llm: LLM) -> dict[str, object]:
    """Step the engine until idle; final outputs by request id."""
    finals = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def rand_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, n)]
