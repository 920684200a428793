"""Unit tests of the engine's input and output processors, without a model or a device."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core import (
    BlockManager,
    SampledToken,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    TokenStops,
)
from pagedjax.input_processor import InputProcessor
from pagedjax.output_processor import OutputProcessor, RequestState
from pagedjax.sampling_params import SamplingParams


class CharTokenizer:
    """One character per token: id = code point - 32 (ids 0..94), EOS = 95."""

    eos_token_id = 95

    def __call__(self, text, add_special_tokens: bool = True):
        enc = lambda t: [ord(c) - 32 for c in t]
        return types.SimpleNamespace(input_ids=[enc(t) for t in text] if isinstance(text, list)
                                     else enc(text))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 32) for i in ids if not (skip_special_tokens and i == 95))

    def decode_batch(self, batch, skip_special_tokens=True):
        return [self.decode(ids, skip_special_tokens) for ids in batch]


def _inputs(blocks=40, bs=8, max_len=128, caching=False, max_num_seqs=8):
    bm = BlockManager(blocks, 0, bs, watermark=0.0, enable_prefix_caching=caching)
    return InputProcessor(CharTokenizer(), 96, max_len, max_num_seqs, bm)


@pytest.mark.parametrize("kwargs,field", [
    ({"request_id": "a\nb"}, "request_id"),
    ({"output_kind": "deltas"}, "output_kind"),
    ({"prompt": "x" * 200}, "prompt"),
    ({"prompt": None, "prompt_token_ids": [1, 96]}, "prompt_token_ids"),
    ({"params": {"n": 9, "temperature": 1.0}}, "n"),
    ({"params": {"prompt_logprobs": -1}, "caching": True}, "prompt_logprobs"),
    ({"params": {"max_tokens": 124}, "strict": True}, "max_tokens"),
    ({"params": {"max_tokens": 100, "n": 4, "temperature": 1.0}, "strict": True}, "max_tokens"),
    ({"params": {"bogus": 1}}, None),
])
def test_input_errors_name_the_field(kwargs, field):
    caching = kwargs.pop("caching", False)
    strict = kwargs.pop("strict", False)
    args = {"request_id": "r", "prompt": "hello", "params": None, "prompt_token_ids": None,
            "output_kind": "cumulative", **kwargs}
    with pytest.raises(ValueError) as e:
        _inputs(caching=caching).process(**args, strict_limits=strict)
    if field is not None:
        assert str(e.value).startswith(field), str(e.value)


def test_input_processing_tokenizes_and_counts_samples():
    r = _inputs().process("r", "hi!", {"n": 3, "temperature": 1.0}, None, "final_only", True)
    assert r.prompt_token_ids == [72, 73, 1] and r.num_samples == 3 and r.prompt == "hi!"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(prompt_len=st.integers(1, 127), samples=st.integers(1, 8), blocks=st.integers(4, 64),
       caching=st.booleans())
def test_max_output_tokens_is_the_boundary_of_check_growth(prompt_len, samples, blocks, caching):
    """Brute force: the largest m with prompt + m <= max_model_len whose worst case fits."""
    ip = _inputs(blocks=blocks, caching=caching)
    bm = ip.block_manager
    want = 0
    for m in range(0, 128 - prompt_len + 1):
        if bm.worst_case_blocks(prompt_len, prompt_len + m, samples) <= bm.growth_capacity:
            want = m
    assert ip.max_output_tokens(prompt_len, samples) == want
    if want:
        ip.check_growth(prompt_len, want, samples)
    if want < 128 - prompt_len:
        with pytest.raises(ValueError, match="^max_tokens"):
            ip.check_growth(prompt_len, want + 1, samples)


def _request(params: SamplingParams, prompt=(10, 11, 12), max_model_len: int = 64):
    """A request queued in a real scheduler, which appends tokens and applies token stops."""
    seq = Sequence(0, list(prompt))
    stops = TokenStops(frozenset() if params.ignore_eos else frozenset({95}),
                       frozenset(params.stop_token_ids or ()), params.min_tokens)
    group = SequenceGroup("r", [seq], 0.0, max_tokens=params.max_tokens, n=1, stops=stops)
    req = RequestState("r", None, list(prompt), params, group, 0, 0.0)
    req.register(seq, 0)
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len), BlockManager(64, 0, 4))
    sched.add_seq_group(group)
    return req, sched


def _feed(out: OutputProcessor, req: RequestState, sched: Scheduler, text: str) -> None:
    """What the engine does with each sampled token: the scheduler applies it, the output
    processor detokenizes and reports stop strings back."""
    seq = req.group.seqs[0]
    lp = types.SimpleNamespace(topk_ids=[[]], topk_logprobs=[[]])
    for c in text:
        if seq.status.is_finished:
            return
        token = ord(c) - 32 if c != "\x00" else 95
        applied = sched.update_from_output([SampledToken("r", seq, token, -0.5)], lambda: 1)
        for r, s in out.process(applied, [(req, 0)], lp):
            sched.stop_seq(s, SequenceStatus.FINISHED_STOPPED, r.request_id)


def test_stop_string_truncates_and_min_tokens_holds_eos_back():
    out = OutputProcessor(CharTokenizer(), {95}, max_model_len=64)
    req, sched = _request(SamplingParams(max_tokens=30, stop=["cd"], min_tokens=2))
    _feed(out, req, sched, "\x00abxcdyz")  # EOS first: banned by min_tokens in sampling, kept here
    res = out.make_output(req, final=True).outputs[0]
    assert res.finish_reason == "stop" and res.stop_reason == "cd"
    assert res.text == "abx" and res.token_ids[-2:] == [ord("c") - 32, ord("d") - 32]

    req, sched = _request(SamplingParams(max_tokens=30, min_tokens=3))
    _feed(out, req, sched, "ab\x00c\x00")
    res = out.make_output(req, final=True).outputs[0]
    assert res.finish_reason == "stop" and res.text == "abc"  # the first EOS came too early


def test_length_limits_and_failures():
    out = OutputProcessor(CharTokenizer(), {95}, max_model_len=8)
    req, sched = _request(SamplingParams(max_tokens=30), max_model_len=8)
    _feed(out, req, sched, "abcdefgh")
    res = out.make_output(req, final=True).outputs[0]
    assert res.finish_reason == "length" and res.text == "abcde"  # 3 prompt + 5 = max_model_len
    req, _ = _request(SamplingParams(max_tokens=2))
    failed = out.fail(req, "boom")
    assert failed.finished and failed.error == "boom"
    assert failed.outputs[0].finish_reason == "abort"
    assert out.generation_tokens_total == 5
