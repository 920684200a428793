"""AsyncEngine semantics on a fake engine: threading, errors, queue limit, abort, drain, deltas."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.async_engine import AsyncEngine, DeltaTracker
from pagedjax.serving.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NotReadyError,
    QueueFullError,
    RequestFailedError,
    UnsupportedError,
    field_of,
)
from tests.serving.fake_engine import FakeEngine


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def aeng(fake):
    a = AsyncEngine(fake).start()
    yield a
    a.shutdown()


def _text(stream) -> tuple[str, str]:
    outs = list(stream)
    return outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason


def test_concurrent_threads_share_one_engine_thread(fake, aeng):
    results = {}

    def run(i):
        results[i] = _text(aeng.add_request(f"r{i}", "hi", {"max_tokens": 3 + i % 4}))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r[1] for i, r in results.items()} == {i: "length" for i in range(12)}
    assert all(results[i][0].count("w") == 3 + i % 4 for i in range(12))
    assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids
    assert aeng.num_in_flight() == 0


def test_priority_reaches_the_engine_for_every_sub_request(fake, aeng):
    """A client request's `priority` goes with each of its prompts to `add_request`; requests
    that give none get 0."""

    async def main():
        streams = await aeng.add_requests_async([("p0", "hi", None), ("p1", "yo", None)],
                                                {"max_tokens": 2}, priority=-4)
        one = await aeng.add_request_async("q", "hi", {"max_tokens": 2})
        for s in [*streams, one]:
            async for _ in s:
                pass

    asyncio.run(main())
    _text(aeng.add_request("t", "hi", {"max_tokens": 2}, priority=7))
    assert fake.priorities == {"p0": -4, "p1": -4, "q": 0, "t": 7}


def test_asyncio_streams():
    async def main(a):
        async def one(i):
            stream = await a.add_request_async(f"a{i}", "hi", {"max_tokens": 4})
            return [o.outputs[0].text async for o in stream], stream.coalesced

        return await asyncio.gather(*(one(i) for i in range(5)))

    a = AsyncEngine(FakeEngine()).start()
    try:
        results = asyncio.run(main(a))
    finally:
        a.shutdown()
    texts = [t for t, _ in results]
    assert [t[-1] for t in texts] == ["w0 w1 w2 w3 "] * 5
    # One output per step (4), less those a busy event loop had not taken before the next
    # one replaced them (latest wins): growing cumulative texts, none lost without a count.
    assert all(len(t) + coalesced == 4 for t, coalesced in results), results
    assert all(a_.startswith(b) and a_ != b for t in texts for b, a_ in zip(t, t[1:]))


def test_validation_errors_name_the_field(aeng):
    with pytest.raises(InvalidRequestError) as e:
        aeng.add_request("x", "", {})
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        aeng.add_request("x", "hi", {"temperature": -1.0})
    assert e.value.field == "temperature"
    with pytest.raises(InvalidRequestError) as e:
        aeng.add_request("x", "hi", {"bogus": 1})
    assert e.value.field == "bogus"
    # refused requests leave nothing behind: the id is free again
    assert _text(aeng.add_request("x", "hi", {"max_tokens": 2}))[1] == "length"


def test_field_of_and_unsupported():
    assert field_of("use_beam_search: not supported") == "use_beam_search"
    assert field_of("Unknown sampling parameter(s): foo, bar.") == "foo"
    from pagedjax.serving.errors import from_value_error

    assert isinstance(from_value_error(ValueError("prompt_logprobs: no")), UnsupportedError)


def test_duplicate_queue_full_and_abort(fake):
    aeng = AsyncEngine(fake, max_waiting_requests=3).start()
    fake.gate.clear()  # nothing progresses: every request stays waiting
    streams = [aeng.add_request(f"q{i}", "hi", {"max_tokens": 50}) for i in range(3)]
    with pytest.raises(DuplicateRequestError):
        aeng.add_request("q0", "hi", {})
    with pytest.raises(QueueFullError):
        aeng.add_request("q3", "hi", {})
    assert aeng.abort("q1") and not aeng.abort("nope")
    assert _text(streams[1])[1] == "abort"
    fake.gate.set()
    assert [_text(s)[1] for s in (streams[0], streams[2])] == ["length", "length"]
    aeng.shutdown()


def test_internal_error_isolated(aeng):
    bad = aeng.add_request("bad", "boom", {"max_tokens": 5})
    good = aeng.add_request("good", "hi", {"max_tokens": 5})
    with pytest.raises(RequestFailedError, match="boom"):
        list(bad)
    assert _text(good) == ("w0 w1 w2 w3 w4 ", "length")


def test_drain_finishes_short_and_aborts_long(fake):
    fake.step_s = 0.01
    a = AsyncEngine(fake).start()
    short = a.add_request("s", "hi", {"max_tokens": 3})
    long = a.add_request("l", "hi", {"max_tokens": 10_000})
    assert a.drain(grace_s=0.3) == 1
    with pytest.raises(NotReadyError):
        a.add_request("late", "hi", {})
    assert _text(short)[1] == "length" and _text(long)[1] == "abort"
    a.shutdown()


def test_metrics_hooks(aeng):
    seen = []
    aeng.on_request_done(seen.append)
    list(aeng.add_request("m", "hi", {"max_tokens": 4}))
    m = seen[-1]
    assert (m.request_id, m.completion_tokens, m.finish_reason, m.prompt_tokens) == ("m", 4, "length", 3)
    assert 0 <= m.ttft <= m.e2e and m.tpot is not None and len(m.itls) == 3


def _out(text: str, finished: bool = False, reason=None) -> RequestOutput:
    return RequestOutput("r", "p", [1], [CompletionOutput(0, text, list(range(len(text))),
                                                          finish_reason=reason)], finished=finished)


def test_delta_tracker_holds_back_partial_stop_strings():
    tr = DeltaTracker(SamplingParams(stop=["END"], max_tokens=50))
    parts = [tr.update(_out("hello E")), tr.update(_out("hello EN")),
             tr.update(_out("hello ", True, "stop"))]
    texts = [d.text for p in parts for d in p]
    # "E" and "EN" might start the stop string: they are never sent, so the deltas add up.
    assert "".join(texts) == "hello "
    assert texts[:2] == ["hello", " "]
    assert parts[-1][-1].finish_reason == "stop"


def test_cancelled_before_acceptance_never_runs(fake):
    """A caller cancelled while its request was still queued leaves nothing running."""
    a = AsyncEngine(fake).start()

    async def main():
        fake.gate.clear()
        blocker = a.submit("blocker", "hi", {"max_tokens": 1})  # keeps the engine busy stepping
        blocker.result(5)
        task = asyncio.ensure_future(a.add_request_async("gone", "hi", {"max_tokens": 3}))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        fake.gate.set()

    try:
        asyncio.run(main())
        for _ in range(200):
            if a.num_in_flight() == 0 and not fake.has_unfinished_requests():
                break
            threading.Event().wait(0.01)
        assert a.num_in_flight() == 0 and "gone" not in fake._reqs
    finally:
        a.shutdown()


def _read_slowly(a: AsyncEngine, mode: str, delta: bool):
    """Start a 200-token request and read nothing until it is done (at most two items pending
    all along); then the stream and everything it yields."""
    async def via_asyncio():
        stream = await a.add_request_async("slow", "hi", {"max_tokens": 200}, delta=delta)
        while a.num_in_flight():
            assert stream.num_pending <= 2
            await asyncio.sleep(0.001)
        return stream, [o async for o in stream]

    try:
        if mode == "thread":
            stream = a.submit("slow", "hi", {"max_tokens": 200}, delta=delta).result()
            while a.num_in_flight():
                assert stream.num_pending <= 2
            return stream, list(stream)
        return asyncio.run(via_asyncio())
    finally:
        a.shutdown()


@pytest.mark.parametrize("mode", ["thread", "asyncio"])
def test_slow_consumer_holds_one_pending_output(mode):
    """A client that reads nothing while 200 tokens are generated holds at most the latest
    cumulative output (plus the end marker), and its deltas still add up to the final text."""
    stream, outs = _read_slowly(AsyncEngine(FakeEngine()).start(), mode, delta=False)
    assert stream.coalesced > 0 and len(outs) <= 2
    tracker = DeltaTracker(SamplingParams(max_tokens=200))
    text = "".join(d.text for o in outs for d in tracker.update(o))
    assert text == outs[-1].outputs[0].text == "".join(f"w{i} " for i in range(200))
    assert outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["thread", "asyncio"])
def test_slow_consumer_of_deltas_holds_one_merged_output(mode):
    """Delta streams (the servers'): a client that reads nothing while 200 tokens are
    generated holds at most one pending output, whose deltas were merged rather than
    replaced, so what it reads still adds up to the whole result; the engine was asked for
    deltas, and the request's token count is the total, not the last delta's."""
    fake = FakeEngine()
    a = AsyncEngine(fake).start()
    done = []
    a.on_request_done(done.append)
    stream, outs = _read_slowly(a, mode, delta=True)
    assert fake._reqs == {} and stream.coalesced > 0 and len(outs) <= 2
    whole = "".join(f"w{i} " for i in range(200))
    tracker = DeltaTracker(SamplingParams(max_tokens=200), delta=True)
    deltas = [d for o in outs for d in tracker.update(o)]
    assert "".join(d.text for d in deltas) == whole
    assert [t for d in deltas for t in d.token_ids] == list(range(200))
    assert deltas[-1].completion_tokens == tracker.completion_tokens == 200
    assert deltas[-1].finish_reason == "length"
    assert done[0].completion_tokens == 200


def test_merge_output_accumulates_deltas_per_index():
    """`merge_output` (the servers' accumulation of delta outputs): text, tokens and logprobs
    appended per output index, an index first seen later added in order, the latest
    cumulative logprob, finish and stop reasons kept; the result equals the cumulative one."""
    from pagedjax.serving.async_engine import merge_output

    def out(comps, finished=False):
        return RequestOutput("r", "p", [1, 2], comps, finished=finished)

    acc = out([CompletionOutput(1, "b", [7], -0.5, [{7: -0.5}])])
    merge_output(acc, out([CompletionOutput(0, "a", [3], -0.1, [{3: -0.1}]),
                           CompletionOutput(1, "c", [8], -0.9, [{8: -0.4}])]))
    merge_output(acc, out([CompletionOutput(0, "x", [4], -0.3, [{4: -0.2}], "stop", "x"),
                           CompletionOutput(1, "", [], -0.9, [], "length")], finished=True))
    assert acc.finished
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
             c.stop_reason) for c in acc.outputs] == [
        (0, "ax", [3, 4], -0.3, [{3: -0.1}, {4: -0.2}], "stop", "x"),
        (1, "bc", [7, 8], -0.9, [{7: -0.5}, {8: -0.4}], "length", None)]


def test_multi_prompt_request_is_admitted_together_or_not_at_all(fake):
    """The sub-requests of one client request enter the engine between the same two steps;
    one bad prompt refuses all of them (none left running), naming which prompt."""
    fake.step_s = 0.01
    a = AsyncEngine(fake).start()
    try:
        items = [(f"m{i}", "hi", None) for i in range(40)]
        futs = a.submit_many(items, {"max_tokens": 2})
        streams = [f.result(timeout=10) for f in futs]
        assert len({fake.added_at[f"m{i}"] for i in range(40)}) == 1
        assert all(_text(s)[1] == "length" for s in streams)

        bad = [("x0", "hi", None), ("x1", "hi", None), ("x2", None, [1, 999]), ("x3", "hi", None)]
        futs = a.submit_many(bad, {"max_tokens": 50})
        errors = set()
        for f in futs:
            with pytest.raises(InvalidRequestError) as e:
                f.result(timeout=10)
            errors.add(e.value.message)
        assert errors == {"prompt_token_ids: token id outside the vocabulary (prompt 2 of 4)"}
        deadline = time.monotonic() + 5
        while (fake._reqs or a.num_in_flight()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not fake._reqs and a.num_in_flight() == 0  # x0, x1 were added, then aborted
    finally:
        a.shutdown()


def test_sequences_per_request_and_waiting_limits_count_every_prompt(fake):
    a = AsyncEngine(fake, max_waiting_requests=5, max_sequences_per_request=8).start()
    seen = []
    a.on_refused(seen.append)
    try:
        with pytest.raises(InvalidRequestError, match=r"^prompt: 3 prompts x 4 samples = 12 "
                                                      r"sequences exceed max_sequences_per_request=8"):
            a.submit_many([(f"s{i}", "hi", None) for i in range(3)], {"n": 4, "temperature": 1.0})
        fake.gate.clear()
        streams = [f.result(timeout=10) for f in
                   a.submit_many([(f"w{i}", "hi", None) for i in range(3)], {"max_tokens": 2})]
        with pytest.raises(QueueFullError, match="3 requests waiting, 3 more"):
            a.submit_many([(f"v{i}", "hi", None) for i in range(3)], {"max_tokens": 2})
        assert a.num_in_flight() == 3  # nothing of the refused request was queued
        fake.gate.set()
        assert all(_text(s)[1] == "length" for s in streams)
        assert [e.kind for e in seen] == ["invalid_argument", "resource_exhausted"]
    finally:
        a.shutdown()


def test_unhealthy_engine_is_not_serving_and_refuses_until_it_recovers(fake):
    a = AsyncEngine(fake).start()
    changes = []
    a.on_health(changes.append)
    try:
        assert a.serving
        fake.healthy = False
        deadline = time.monotonic() + 5
        while a.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not a.serving and a.accepting and changes == [False]
        with pytest.raises(NotReadyError, match="rebuilding its KV cache"):
            a.add_request("r", "hi", {"max_tokens": 2})
        fake.healthy = True
        while not a.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert changes == [False, True]
        assert _text(a.add_request("r", "hi", {"max_tokens": 2}))[1] == "length"
    finally:
        a.shutdown()


def test_samples_of_a_single_prompt_over_the_cap_name_n(fake):
    a = AsyncEngine(fake, max_sequences_per_request=8).start()
    try:
        with pytest.raises(InvalidRequestError, match=r"^n: 1 prompts x 9 samples") as e:
            a.add_request("one", "hi", {"n": 9, "temperature": 1.0})
        assert e.value.field == "n"
        with pytest.raises(InvalidRequestError, match=r"^best_of: 1 prompts x 9 samples"):
            a.add_request("two", "hi", {"n": 2, "best_of": 9, "temperature": 1.0})
    finally:
        a.shutdown()


def test_idle_unhealthy_engine_keeps_stepping_until_it_recovers():
    """With nothing in flight the engine thread normally sleeps; an unhealthy engine must still
    step (that is where it retries its KV cache), or it would refuse requests forever."""

    class Recovering(FakeEngine):
        def step(self):
            if not self.healthy:
                self.retries += 1
                self.healthy = self.retries >= 5
            return super().step()

    fake = Recovering()
    fake.retries = 0
    a = AsyncEngine(fake).start()
    try:
        fake.healthy = False
        deadline = time.monotonic() + 5
        while fake.retries < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.retries == 5
        while not a.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.serving and _text(a.add_request("r", "hi", {"max_tokens": 2}))[1] == "length"
    finally:
        a.shutdown()


def test_a_step_wakes_each_event_loop_once_and_loses_no_output():
    """The engine thread hands a step's outputs to their streams, then wakes each event loop
    once (`wake_streams`), not each stream: every delta still arrives, in order, and the
    streams end; the loop was woken for outputs at most once per engine step."""
    from pagedjax.serving import async_engine

    wakes = []

    async def main(a):
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            if threading.current_thread().name == "pagedjax-engine":
                wakes.append(fn)
            return real(fn, *args, **kw)

        loop.call_soon_threadsafe = counting
        items = [(f"s{i}", "hi", None) for i in range(24)]
        streams = await a.add_requests_async(items, {"max_tokens": 6}, delta=True)

        async def read(stream):
            return [(o.outputs[0].text, o.finished) async for o in stream]

        return await asyncio.gather(*(read(s) for s in streams))

    fake = FakeEngine()
    a = AsyncEngine(fake).start()
    try:
        results = asyncio.run(main(a))
    finally:
        a.shutdown()
    whole = "".join(f"w{i} " for i in range(6))
    assert all("".join(t for t, _ in r) == whole and r[-1][1] for r in results)
    stream_wakes = [fn for fn in wakes if fn is async_engine._set_all]
    # No stream was woken on its own: every wake of a delivered output went through one
    # per-loop callback, at most one a step (24 streams x 6 tokens = 144 outputs).
    assert not [fn for fn in wakes if getattr(fn, "__name__", "") == "set"]
    assert 1 <= len(stream_wakes) <= fake.steps


def test_wake_streams_once_per_loop_thread_consumers_and_closed_loops():
    """`wake_streams` wakes thread consumers by their event and asyncio consumers by one
    callback per loop, each stream once however often it is listed; a closed loop is skipped
    without stopping the others. Items put with ``wake=False`` wake nobody until then."""
    from pagedjax.serving.async_engine import RequestStream, wake_streams

    loops = [asyncio.new_event_loop() for _ in range(3)]
    threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops[:2]]
    for t in threads:
        t.start()
    loops[2].close()  # its clients are gone
    calls = {id(lp): 0 for lp in loops}
    for lp in loops[:2]:
        real = lp.call_soon_threadsafe

        def counting(fn, *args, _real=real, _lp=lp):
            calls[id(_lp)] += 1
            return _real(fn, *args)

        lp.call_soon_threadsafe = counting
    try:
        async def make(n):
            return [RequestStream(f"x{i}", asyncio.get_running_loop()) for i in range(n)]

        on = [asyncio.run_coroutine_threadsafe(make(3), lp).result() for lp in loops[:2]]
        calls.update({k: 0 for k in calls})  # run_coroutine_threadsafe used the loops too
        closed = RequestStream("gone", loops[2])
        threaded = RequestStream("t")
        every = on[0] + on[1] + [closed, threaded]
        out = RequestOutput("x", None, [1], [CompletionOutput(0, "a", [5])], False)
        for s in every:
            s._put(out, wake=False)
        time.sleep(0.05)
        assert not any(s._aready.is_set() for s in on[0] + on[1] + [closed])
        assert not threaded._tready.is_set() and calls == {id(lp): 0 for lp in loops}
        wake_streams(every + on[0] + [threaded])  # listed twice: woken once
        assert threaded._tready.is_set()
        assert [calls[id(lp)] for lp in loops] == [1, 1, 0]
        for lp, streams in zip(loops[:2], on):
            async def events_set(ss=streams):
                return [s._aready.is_set() for s in ss]

            assert asyncio.run_coroutine_threadsafe(events_set(), lp).result() == [True] * 3
        assert not closed._aready.is_set()
    finally:
        for lp in loops[:2]:
            lp.call_soon_threadsafe(lp.stop)
        for t in threads:
            t.join(5)
        for lp in loops[:2]:
            lp.close()


def test_servers_run_on_uvloop_unless_turned_off(monkeypatch):
    """`pagedjax serve` (and the in-process test servers) run on uvloop's loop, as vLLM's
    server does; PAGEDJAX_UVLOOP=0 gives asyncio's own."""
    import uvloop

    from pagedjax.serving.server import new_event_loop

    monkeypatch.delenv("PAGEDJAX_UVLOOP", raising=False)
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()
    monkeypatch.setenv("PAGEDJAX_UVLOOP", "0")
    loop = new_event_loop()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop) and not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


class _BadOutputEngine(FakeEngine):
    """Request "bad"'s outputs break delivery (no prompt ids: an engine bug), its neighbours'
    are fine; ``stats_fail`` makes `get_stats` raise too."""

    stats_fail = False

    def _output(self, rid, r, finished, reason=None, error=None):
        out = super()._output(rid, r, finished, reason, error)
        if rid == "bad" and r["prompt"] == "poison":
            out.prompt_token_ids = None
        return out

    def get_stats(self):
        if self.stats_fail:
            raise RuntimeError("stats broke")
        return super().get_stats()


def test_a_failing_delivery_ends_that_stream_only_and_the_thread_lives():
    fake = _BadOutputEngine()
    aeng = AsyncEngine(fake).start()
    fake.stats_fail = True  # from here on, every step's stats raise too
    try:
        bad = aeng.add_request("bad", "poison", {"max_tokens": 50})
        good = aeng.add_request("good", "hi", {"max_tokens": 6})
        with pytest.raises(RequestFailedError, match="internal error: TypeError"):
            list(bad)
        assert _text(good) == ("w0 w1 w2 w3 w4 w5 ", "length")
        assert "bad" not in fake._reqs  # withdrawn from the engine, no abort output queued
        assert not any(o.request_id == "bad" for o in fake._pending)
        # The id is free at once, and the engine thread still serves.
        again = aeng.add_request("bad", "fine", {"max_tokens": 3})
        assert _text(again) == ("w0 w1 w2 ", "length")
        assert aeng.num_in_flight() == 0
    finally:
        aeng.shutdown()


def test_a_failing_command_fails_in_flight_streams_but_not_the_thread(fake):
    aeng = AsyncEngine(fake).start()
    real_abort = fake.abort_request
    try:
        fake.gate.clear()  # hold progress so "slow" is in flight when the abort breaks
        slow = aeng.add_request("slow", "hi", {"max_tokens": 5})

        def broken(*a, **k):
            raise RuntimeError("abort broke")

        fake.abort_request = broken
        aeng.abort("slow")
        with pytest.raises(RequestFailedError, match="internal error"):
            list(slow)
        fake.abort_request = real_abort
        fake.gate.set()
        assert _text(aeng.add_request("next", "hi", {"max_tokens": 2})) == ("w0 w1 ", "length")
    finally:
        fake.abort_request = real_abort
        aeng.shutdown()
