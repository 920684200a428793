"""`LLMEngine.freeze_gc`: what the server calls once it is loaded and warm."""

from __future__ import annotations

import gc

from pagedjax.engine import YOUNG_GC_THRESHOLD, LLMEngine


def test_freeze_gc_freezes_the_heap_and_widens_the_young_generation():
    before = gc.get_threshold()
    try:
        LLMEngine.freeze_gc()
        assert gc.get_freeze_count() > 0
        after = gc.get_threshold()
        assert after[0] == max(before[0], YOUNG_GC_THRESHOLD) and after[1:] == before[1:]
        gc.set_threshold(2 * YOUNG_GC_THRESHOLD, *before[1:])  # a wider one is kept
        LLMEngine.freeze_gc()
        assert gc.get_threshold()[0] == 2 * YOUNG_GC_THRESHOLD
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
