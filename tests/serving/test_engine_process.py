"""`EngineProcess`: the engine in a spawned child behind `AsyncEngine`, with the serving tests'
JAX-free engine in the child (`tests/serving/fake_engine.py`); a real `pagedjax serve
--engine-process` is in test_lifecycle.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedjax.serving.async_engine import AsyncEngine
from pagedjax.serving.engine_process import EngineDied, EngineProcess
from pagedjax.serving.errors import InvalidRequestError, NotReadyError, RequestFailedError
from tests.serving.fake_engine import (
    FailingStepEngine,
    FakeEngine,
    PriorityStampEngine,
    ResetStampEngine,
    StepStampEngine,
    failing_factory,
)


@pytest.fixture(scope="module")
def proc():
    p = EngineProcess(FakeEngine, 0.002)
    yield p
    assert p.close() == 0  # stopped by its command, not killed


@pytest.fixture
def aeng(proc):
    a = AsyncEngine(proc).start()
    yield a
    a.shutdown()
    # Nothing left running in the child after every test.
    deadline = time.monotonic() + 5
    while proc.has_unfinished_requests() and time.monotonic() < deadline:
        proc.step()
    assert not proc.has_unfinished_requests()
    assert proc.get_stats().num_running == 0


def _streams(aeng, n: int, kind: str, max_tokens) -> dict[str, list]:
    async def main():
        async def one(i):
            stream = await aeng.add_request_async(f"{kind}{i}", "hi",
                                                  {"max_tokens": max_tokens(i)},
                                                  delta=kind == "delta")
            return [o async for o in stream]

        return await asyncio.gather(*(one(i) for i in range(n)))

    return dict(zip((f"{kind}{i}" for i in range(n)), asyncio.run(main())))


def test_front_info_comes_from_the_child(proc):
    assert proc.pid != os.getpid()
    assert (proc.model_name, proc.max_model_len, proc.runner.num_gpu_blocks) == ("fake", 64, 32)
    assert proc.engine_config.block_size == 16 and proc.model_config.vocab_size == 100
    assert proc.tokenizer("abc").input_ids == [1, 2, 3]
    assert proc.max_output_tokens(10) == 54
    with pytest.raises(ValueError, match="^prompt"):
        proc.check_prompt_text("")


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_every_token_arrives_in_order_through_the_pipe(aeng, kind):
    outs = _streams(aeng, 24, kind, lambda i: 3 + i % 7)
    for i, (rid, got) in enumerate(outs.items()):
        want = [f"w{t} " for t in range(3 + i % 7)]
        comps = [o.outputs[0] for o in got]
        if kind == "delta":
            assert "".join(c.text for c in comps) == "".join(want), rid
            assert [t for c in comps for t in c.token_ids] == list(range(3 + i % 7))
        else:  # latest wins while the client lags: the last output holds everything
            assert comps[-1].text == "".join(want) and comps[-1].token_ids == list(range(3 + i % 7))
        assert comps[-1].finish_reason == "length" and got[-1].finished
    assert aeng.num_in_flight() == 0


def test_admission_errors_name_the_field_and_admit_all_or_none(aeng, proc):
    with pytest.raises(InvalidRequestError, match="prompt_token_ids") as err:
        aeng.submit_many([("ok0", None, [5, 6]), ("bad1", None, [5, 999])],
                         {"max_tokens": 50}).__getitem__(1).result(10)
    assert "prompt 1 of 2" in err.value.message
    # The first prompt was added in the child, then withdrawn with its sibling: no tokens
    # for it, and the child is idle again.
    deadline = time.monotonic() + 5
    while proc.get_stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.get_stats().num_running == 0 and aeng.num_in_flight() == 0
    # The same ids are free again, in the child too.
    texts = [list(s)[-1].outputs[0].text for s in (aeng.add_request("ok0", None, {"max_tokens": 2},
                                                                     [5, 6]),)]
    assert texts == ["w0 w1 "]


def test_abort_reaches_the_child_and_ends_the_stream(aeng, proc):
    stream = aeng.add_request("long", "hi", {"max_tokens": 10_000})
    first = next(iter(stream))
    assert first.outputs[0].token_ids
    assert aeng.abort("long")
    rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 10_000


def test_an_error_in_one_request_stays_in_it(aeng):
    bad = aeng.add_request("b", "boom", {"max_tokens": 3})
    good = aeng.add_request("g", "hi", {"max_tokens": 3})
    with pytest.raises(RequestFailedError, match="boom"):
        list(bad)
    assert list(good)[-1].outputs[0].text == "w0 w1 w2 "


def test_a_failed_step_fails_the_requests_and_the_engine_serves_on():
    p = EngineProcess(FailingStepEngine, 0.002)
    a = AsyncEngine(p).start()
    try:
        with pytest.raises(RequestFailedError, match="internal error"):
            list(a.add_request("x", "crash", {"max_tokens": 3}))
        assert list(a.add_request("y", "hi", {"max_tokens": 2}))[-1].outputs[0].text == "w0 w1 "
    finally:
        a.shutdown()
        assert p.close() == 0


def test_a_killed_engine_process_fails_its_streams_and_stops_serving():
    p = EngineProcess(FakeEngine, 0.002)
    a = AsyncEngine(p).start()
    try:
        stream = a.add_request("s", "hi", {"max_tokens": 100_000})
        next(iter(stream))
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RequestFailedError, match="engine process exited"):
            list(stream)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while a.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not a.serving and not p.healthy
        with pytest.raises(NotReadyError, match="engine process exited .* restarted"):
            a.add_request("t", "hi", {"max_tokens": 2})
    finally:
        a.shutdown()
        assert p.close() == -signal.SIGKILL


def test_an_engine_that_fails_to_build_raises_with_its_error():
    with pytest.raises(EngineDied, match="no weights here"):
        EngineProcess(failing_factory, "no weights here")


def test_priority_reaches_the_child_for_text_and_text_free_requests():
    """`priority` crosses the pipe with every sub-request, for requests the child detokenizes
    and for those decoded in the front end (their items are rebuilt as "delta_ids")."""
    p = EngineProcess(PriorityStampEngine, 0.002)
    a = AsyncEngine(p).start()
    try:
        async def main():
            out = {}
            for delta, prio in ((True, -3), (False, 9), (True, 0)):
                rids = [(f"{delta}{prio}-{i}", "hi", None) for i in range(2)]
                streams = await a.add_requests_async(rids, {"max_tokens": 2}, delta=delta,
                                                     priority=prio)
                for (rid, _, _), s in zip(rids, streams):
                    out[rid] = [o.num_cached_tokens async for o in s]
            return out

        got = asyncio.run(main())  # a consumer that is behind gets outputs merged: 1 or 2
        assert {rid: set(v) for rid, v in got.items()} == {
            f"{d}{q}-{i}": {q} for d, q in ((True, -3), (False, 9), (True, 0)) for i in range(2)}
    finally:
        a.shutdown()
        assert p.close() == 0


@pytest.mark.parametrize("in_child", [False, True])
def test_a_prefix_cache_reset_reaches_the_engine_before_later_requests(in_child):
    """`AsyncEngine.reset_prefix_cache_async` (the dev `/reset_prefix_cache`): applied on the
    engine's side, in the engine process's child too, before any request submitted after it
    returns; requests before it see none."""
    p = EngineProcess(ResetStampEngine, 0.002) if in_child else ResetStampEngine(0.002)
    a = AsyncEngine(p).start()
    try:
        async def seen(rid):
            s = await a.add_request_async(rid, "hi", {"max_tokens": 2}, delta=True)
            return {o.num_cached_tokens async for o in s}

        async def main():
            before = await seen("before")
            assert await a.reset_prefix_cache_async() is True
            after = await seen("after")
            await a.reset_prefix_cache_async()
            return before, after, await seen("twice")

        assert asyncio.run(main()) == ({0}, {1}, {2})
    finally:
        a.shutdown()
        if in_child:
            assert p.close() == 0


def test_a_burst_of_clients_is_admitted_between_two_steps_not_one_a_step():
    p = EngineProcess(StepStampEngine, 0.05)  # slow steps: the burst arrives mid-step
    a = AsyncEngine(p).start()
    try:
        first = a.add_request("first", "hi", {"max_tokens": 50})
        next(iter(first))  # the child is stepping now
        futs = [a.submit(f"b{i}", "hi", {"max_tokens": 2}) for i in range(20)]
        outs = [list(f.result(30))[-1] for f in futs]
        stamps = {o.num_cached_tokens for o in outs}
        # One round trip for all that were queued: one or two admission steps (the burst may
        # straddle one), not 20.
        assert len(stamps) <= 2, stamps
        a.abort("first")
        list(first)
    finally:
        a.shutdown()
        assert p.close() == 0


class _CharTokenizer:
    """Token t is the letter ``chr(97 + t)``."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + t) for t in ids)


def _front_end():
    """An `EngineProcess`'s front end alone: its `_decode`, with the commands it sends kept."""
    from pagedjax.detokenizer import Detokenizer

    ep = object.__new__(EngineProcess)
    ep._detok = Detokenizer(_CharTokenizer())
    ep._texts, ep._dropping, ep._dead = {}, set(), None
    ep.num_front_stops = ep.num_front_sample_stops = 0
    sent = []
    ep._send = lambda kind, *payload, reply=None: sent.append((kind, *payload))
    return ep, sent


def _out(finished: bool, *comps):
    from pagedjax.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [0], [CompletionOutput(i, "", list(t), None, None, f, None)
                                          for i, t, f in comps], finished)


def _said(outs) -> list:
    return [(o.finished, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                          for c in o.outputs]) for o in outs]


def test_a_request_ends_in_the_front_end_when_its_last_sibling_ends_in_the_child():
    """A sample stopped in the front end runs on in the child until the word arrives; if its
    siblings end in the child meanwhile, the request ends with that output, as in the
    engine, not with a later one."""
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.serving.engine_process import _FrontText

    ep, sent = _front_end()
    ep._texts["r"] = _FrontText(True, SamplingParams(n=2, stop=["x"]), 2)
    x = ord("x") - 97
    assert _said(ep._decode([_out(False, (0, [0], None), (1, [1], None))])) == \
        [(False, [(0, "a", [0], None, None), (1, "b", [1], None, None)])]
    assert _said(ep._decode([_out(False, (0, [x], None), (1, [2], None))])) == \
        [(False, [(0, "", [x], "stop", "x"), (1, "c", [2], None, None)])]
    assert sent == [("stop_samples", [("r", 0, "x")])]
    # The child ran sample 0 one token past its stop and ended sample 1 by its length.
    assert _said(ep._decode([_out(False, (0, [3], None), (1, [4], "length"))])) == \
        [(True, [(0, "", [], "stop", "x"), (1, "e", [4], "length", None)])]
    assert sent[1:] == [("abort", ["r"], False)]
    assert ep._decode([_out(True, (0, [], "stop"), (1, [], "length"))]) == []  # its end
    assert not ep._texts and not ep._dropping
    assert (ep.num_front_stops, ep.num_front_sample_stops) == (1, 1)


def test_samples_stopped_in_the_front_end_say_so_in_later_outputs_until_the_last_stops():
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.serving.engine_process import _FrontText

    ep, sent = _front_end()
    ep._texts["r"] = _FrontText(True, SamplingParams(n=3, stop=["x"]), 3)
    x = ord("x") - 97
    ep._decode([_out(False, (0, [x], None), (1, [1], None), (2, [2], None))])
    got = _said(ep._decode([_out(False, (0, [5], None), (1, [x], None), (2, [3], None))]))
    assert got == [(False, [(0, "", [], "stop", "x"), (1, "", [x], "stop", "x"),
                            (2, "d", [3], None, None)])]
    assert sent == [("stop_samples", [("r", 0, "x")]), ("stop_samples", [("r", 1, "x")])]
    got = _said(ep._decode([_out(False, (0, [], "stop"), (1, [6], None), (2, [x], None))]))
    assert got == [(True, [(0, "", [], "stop", "x"), (1, "", [], "stop", "x"),
                           (2, "", [x], "stop", "x")])]
    assert sent[2:] == [("abort", ["r"], False)]  # the last one: no stop_samples of its own
    assert ep._decode([_out(True, (0, [], "stop"), (1, [], "stop"), (2, [], "abort"))]) == []
    assert not ep._texts and not ep._dropping
