"""Shared fixtures: the demo model is loaded once per test process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


class CollidingKey:
    """A prefix-cache key that hashes like every other, for tests that replace
    `block_pool.block_key` with it: the cache must tell blocks apart by their content alone."""

    __slots__ = ("fields",)

    def __init__(self, *fields) -> None:
        self.fields = fields

    def __hash__(self) -> int:
        return 42

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CollidingKey) and self.fields == other.fields

# Serving on CPU defaults to the unrolled layer loop, whose step shapes compile ~9x slower;
# the suite compiles hundreds of shapes, so it runs the scan unless a test asks for the loop
# (tests/engine/test_layer_loop.py checks both give the same tokens).
os.environ.setdefault("PAGEDJAX_LAYER_LOOP", "scan")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """Drop JAX's compilation caches after each test module. Every compiled XLA:CPU
    executable keeps its code mapped (about 300 mappings a second while a module builds
    engines), and the jitted methods' caches hold the runners alive; a worker running half
    the suite passed Linux's 65 530-mapping limit and segfaulted inside the compiler."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    from models.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def demo_model(demo_gguf):
    """(config, params) of the demo model in fp32."""
    from models.gguf_loader import load_gguf

    return load_gguf(demo_gguf)


@pytest.fixture(scope="session")
def demo_tokenizer(demo_gguf):
    from models.tokenizer import load_tokenizer

    return load_tokenizer(demo_gguf)


@pytest.fixture(scope="session")
def hf_goldens() -> dict:
    return json.loads((DATA / "hf_goldens.json").read_text())
