"""The n-gram proposer against a brute-force search, the acceptance rule, and the config's
validation (pure Python, no JAX)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import EngineConfig
from pagedjax.spec import NgramProposer, SpeculativeConfig, accepted_prefix


def brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n first; its latest earlier occurrence; the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 3))
def test_matches_brute_force(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = NgramProposer(k, min_n, max_n).propose(tokens)
    assert got == brute(tokens, k, min_n, max_n)
    assert len(got) <= k


def test_examples():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2]) == [3, 9, 1]  # "1 2" seen before: continue it
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([7, 7]) == [7]  # a run continues
    assert p.propose([5, 1, 2, 6, 1, 2], k=1) == [6]  # the latest occurrence wins
    assert p.propose([1, 2, 3, 1, 2, 3], k=0) == []


def test_acceptance_rule():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_prefix([4], [3, 4]) == 0


@pytest.mark.parametrize("bad,field", [
    ({"method": "medusa"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"draft": 1}, "unknown field"),
    ("{not json", "JSON"),
])
def test_config_names_the_bad_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


def test_config_forms_and_exclusions():
    want = SpeculativeConfig(num_speculative_tokens=5)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 5}).speculative_config == want
    assert EngineConfig(speculative_config='{"num_speculative_tokens": 5}').speculative_config == want
    # Composes with async scheduling (tests/engine/test_speculative.py::test_async_*).
    assert EngineConfig(speculative_config={}, async_scheduling=True).async_scheduling
    with pytest.raises(ValueError, match="kv_policy"):
        EngineConfig(speculative_config={}, kv_policy="contiguous-max")
