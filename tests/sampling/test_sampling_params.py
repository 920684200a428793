"""SamplingParams validation: every bad field raises ValueError naming it."""

from __future__ import annotations

import pytest

from pagedjax.sampling_params import SamplingParams, SamplingType

INVALID = [
    ({"n": 0}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop": 3}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"early_stopping": "sometimes", "use_beam_search": True, "best_of": 2,
      "temperature": 0.0}, "early_stopping"),
    ({"use_beam_search": True, "best_of": 1, "temperature": 0.0}, "best_of"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.0, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.0, "top_k": 5}, "top_k"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.0, "min_p": 0.1}, "min_p"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"temperature": 0.0, "n": 2}, "best_of"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),  # fuzz: would overflow the int32 ban list
    ({"top_p": True}, "top_p"),
] + [({name: bad}, name)
     for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "length_penalty")
     for bad in (float("inf"), float("-inf"), float("nan"))]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_field_raises_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams.from_dict(kwargs)


def test_from_dict_rejects_unknown_field() -> None:
    with pytest.raises(ValueError, match="bogus_knob"):
        SamplingParams.from_dict({"temperature": 0.5, "bogus_knob": 1})
    with pytest.raises(ValueError, match="_stop_list"):  # internal, not an input
        SamplingParams.from_dict({"_stop_list": []})


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert p.best_of == 1 and p.top_k == -1 and p.stop_strings == []
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties


@pytest.mark.parametrize("stop", [None, "###", ["a", "bcd", "ef"], ("xy", "z")])
def test_stop_strings_worked_out_once_match_the_list(stop) -> None:
    """`stops` and `longest_stop`, read for every token, are fixed at construction: they
    agree with `stop_strings` however ``stop`` was given, and a clone with new stop
    strings works them out again."""
    p = SamplingParams(stop=stop)
    assert list(p.stops) == p.stop_strings
    assert p.longest_stop == max((len(s) for s in p.stop_strings), default=0)
    assert p.has_stop_strings == bool(p.stop_strings)
    q = p.clone(stop=["long stop string", "s"])
    assert q.stops == ("long stop string", "s") and q.longest_stop == 16
    p.stop_strings.append("mutated copy")  # a copy: the params' own list is untouched
    assert "mutated copy" not in p.stops


def test_beam_search_params() -> None:
    p = SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0.0,
                       length_penalty=0.7, early_stopping="never")
    assert p.beam_width == 4 and p.sampling_type is SamplingType.BEAM
    assert SamplingParams(use_beam_search=True, n=3, temperature=0).beam_width == 3


def test_repr_and_from_dict_roundtrip() -> None:
    p = SamplingParams(temperature=0.3, stop=["a", "b"], logprobs=5)
    r = repr(p)
    assert r.startswith("SamplingParams(") and "temperature=0.3" in r and "_stop_list" not in r
    assert SamplingParams.from_dict({"temperature": 0.3, "stop": ["a", "b"],
                                     "logprobs": 5}).stop_strings == ["a", "b"]
    assert p.clone(temperature=0.9).temperature == 0.9
