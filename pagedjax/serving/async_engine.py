"""`AsyncEngine`: a thread-safe front for the (single-threaded) `LLMEngine`.

One background thread owns the engine and drives `step()`; every other thread talks to it through
a command queue. Requests therefore join the running batch at the next step boundary (continuous
batching across clients), aborts from any thread are applied between steps (blocks freed there),
and a failure inside one request reaches only that request's stream. Validation, queue limits,
per-request timings and draining live here so the gRPC and HTTP front doors share them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.errors import (
    DuplicateRequestError,
    NotReadyError,
    QueueFullError,
    RequestFailedError,
    ServingError,
    UnsupportedError,
    from_value_error,
)

logger = logging.getLogger("pagedjax.serving")

_END = object()
_EMPTY = object()


@dataclasses.dataclass
class RequestMetrics:
    """Timings of one request, taken on the engine thread (monotonic seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    itls: list[float] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (the decode speed a client sees)."""
        if self.first_token is None or self.last_token is None or self.completion_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.completion_tokens - 1)


class RequestStream:
    """Outputs of one request, iterable from threads (`for`) or asyncio (`async for`).

    Items are cumulative `RequestOutput`s; iteration ends after the finished one and raises
    `RequestFailedError` if the engine failed the request.

    Bounded: because every output carries the whole result so far, an unfinished output that
    the consumer has not taken yet is replaced by the next one (latest wins). A slow client
    therefore holds at most one pending output plus the terminal items, whatever the
    generation length, and simply sees larger deltas (`DeltaTracker` diffs against what it
    last saw) — backpressure without blocking the engine thread.
    """

    def __init__(self, request_id: str, aloop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._aloop = aloop
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._tready = threading.Event()
        self._aready: asyncio.Event | None = asyncio.Event() if aloop is not None else None
        self.finished = False
        self.coalesced = 0  # outputs replaced before the consumer took them

    def _put(self, item) -> None:  # engine thread
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if (isinstance(item, RequestOutput) and isinstance(last, RequestOutput)
                    and not last.finished):
                self._pending[-1] = item
                self.coalesced += 1
            else:
                self._pending.append(item)
        if self._aready is None:
            self._tready.set()
            return
        try:
            self._aloop.call_soon_threadsafe(self._aready.set)
        except RuntimeError:  # the client's event loop is gone: nobody is listening
            pass

    def _take(self):
        with self._lock:
            return self._pending.popleft() if self._pending else _EMPTY

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _handle(self, item) -> RequestOutput:
        if item is _END:
            self.finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._aready is not None:
            raise TypeError("this stream was opened from asyncio: use `async for`")
        while not self.finished:
            item = self._take()
            if item is _EMPTY:
                self._tready.clear()
                item = self._take()  # a put between the take and the clear
                if item is _EMPTY:
                    self._tready.wait()
                    continue
            try:
                yield self._handle(item)
            except StopIteration:
                return

    def __aiter__(self):
        if self._aready is None:
            raise TypeError("this stream was opened from a thread: use `for`")
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            item = self._take()
            if item is _EMPTY:
                self._aready.clear()
                item = self._take()
                if item is _EMPTY:
                    await self._aready.wait()
                    continue
            try:
                return self._handle(item)
            except StopIteration:
                raise StopAsyncIteration from None
        raise StopAsyncIteration


@dataclasses.dataclass
class _Live:
    stream: RequestStream
    metrics: RequestMetrics
    accepted: concurrent.futures.Future
    completion_tokens: int = 0


@dataclasses.dataclass
class Delta:
    """What is new in one output index since the last update (for streaming clients)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    completion_tokens: int
    cumulative_logprob: float | None


class DeltaTracker:
    """Turns cumulative outputs into deltas whose concatenation equals the final text.

    While a request with stop strings is running, the last `max(len(stop)) - 1` characters are
    held back: the engine truncates the text when a stop string completes, and text already sent
    could not be taken back.
    """

    def __init__(self, params: SamplingParams):
        stops = params.stop_strings
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}

    def update(self, out: RequestOutput) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            done = c.finish_reason is not None
            visible = len(c.text) if done else max(0, len(c.text) - self._hold)
            t0 = self._sent_text.get(c.index, 0)
            k0 = self._sent_tokens.get(c.index, 0)
            text = c.text[t0:visible] if visible > t0 else ""
            toks = c.token_ids[k0:]
            if not text and not toks and not done:
                continue
            self._sent_text[c.index] = max(t0, visible)
            self._sent_tokens[c.index] = len(c.token_ids)
            lps = c.logprobs[k0:] if c.logprobs is not None else None
            deltas.append(Delta(c.index, text, list(toks), lps, c.finish_reason, c.stop_reason,
                                len(c.token_ids), c.cumulative_logprob))
        return deltas


def to_params(params: SamplingParams | dict | None) -> SamplingParams:
    """Validate sampling params on the caller's thread (no engine state needed)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        try:
            params = SamplingParams.from_dict(dict(params))
        except ValueError as exc:
            raise from_value_error(exc) from None
        except TypeError as exc:
            raise from_value_error(ValueError(f"sampling_params: {exc}")) from None
    if params.prompt_logprobs is not None:
        # The engine computes them (LLM API), but neither front door's response carries them yet.
        raise UnsupportedError("prompt_logprobs: not carried by gRPC/HTTP responses yet; use the "
                               "Python API", "prompt_logprobs")
    return params


class AsyncEngine:
    """Drives an `LLMEngine` on one background thread; safe to call from any thread or loop."""

    def __init__(self, engine, max_waiting_requests: int | None = None, idle_wait_s: float = 0.05):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._accepting = True
        self._stopping = False
        self._stats = engine.get_stats()
        self._done_listeners: list[Callable[[RequestMetrics], None]] = []
        self._stats_listeners: list[Callable[[object], None]] = []
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopping

    def on_request_done(self, fn: Callable[[RequestMetrics], None]) -> None:
        """Register a callback run on the engine thread when a request finishes (metrics)."""
        self._done_listeners.append(fn)

    def on_stats(self, fn: Callable[[object], None]) -> None:
        """Register a callback run on the engine thread with fresh `EngineStats`."""
        self._stats_listeners.append(fn)

    def stop_accepting(self) -> None:
        """Refuse new requests (`NotReadyError`) from now on; in-flight ones continue."""
        with self._lock:
            self._accepting = False

    def drain(self, grace_s: float) -> int:
        """Stop accepting, let in-flight requests finish for up to `grace_s`, abort the rest.

        Returns how many requests were aborted."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            rest = list(self._live)
        for rid in rest:
            self.abort(rid)
        deadline = time.monotonic() + 10.0
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(rest)

    def shutdown(self, grace_s: float = 0.0) -> None:
        self.drain(grace_s)
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    # ---- requests ----------------------------------------------------------
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def submit(self, request_id: str, prompt: str | None, params: SamplingParams | dict | None,
               prompt_token_ids: list[int] | None = None,
               aloop: asyncio.AbstractEventLoop | None = None) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its stream once the engine accepted it.

        Errors known without the engine (duplicate id, queue full, draining, bad sampling
        params) raise `ServingError` here; prompt errors arrive through the future."""
        sp = to_params(params)
        stream = RequestStream(request_id, aloop)
        live = _Live(stream, RequestMetrics(request_id, time.monotonic()), concurrent.futures.Future())
        with self._lock:
            if not self.accepting:
                raise NotReadyError("server is draining or stopped")
            if request_id in self._live:
                raise DuplicateRequestError(f"request_id: {request_id!r} is already in flight",
                                            "request_id")
            if self.max_waiting_requests is not None:
                waiting = sum(1 for x in self._live.values() if x.metrics.first_token is None)
                if waiting >= self.max_waiting_requests:
                    raise QueueFullError(f"{waiting} requests waiting (max_waiting_requests="
                                         f"{self.max_waiting_requests})")
            self._live[request_id] = live
        self._cmds.put(("add", request_id, prompt, sp, prompt_token_ids))
        self._wake.set()
        return live.accepted

    def add_request(self, request_id: str, prompt: str | None, params=None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Blocking add from a thread; raises `ServingError` if the request is refused."""
        return self.submit(request_id, prompt, params, prompt_token_ids).result()

    async def add_request_async(self, request_id: str, prompt: str | None, params=None,
                                prompt_token_ids: list[int] | None = None) -> RequestStream:
        fut = self.submit(request_id, prompt, params, prompt_token_ids, asyncio.get_running_loop())
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller went away before the engine took the request
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Abort from any thread; blocks are freed at the next step boundary.

        Returns False if the request is not in flight."""
        with self._lock:
            if request_id not in self._live:
                return False
        self._cmds.put(("abort", request_id))
        self._wake.set()
        return True

    def get_stats(self):
        """The `EngineStats` published after the engine thread's latest step."""
        return self._stats

    # ---- engine thread -----------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            self._apply_commands()
            if not eng.has_unfinished_requests():
                self._publish_stats()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as exc:  # the engine isolates request failures; this is a last resort
                logger.exception("engine step raised")
                self._fail_all(f"internal error: {type(exc).__name__}: {exc}")
                continue
            now = time.monotonic()
            self._publish_stats()  # first, so a client that saw this step's output sees its stats
            for out in outs:
                self._deliver(out, now)
        self._fail_all("server stopped")

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                continue
            _, rid, prompt, sp, ids = cmd
            with self._lock:
                live = self._live.get(rid)
            if live is None:
                continue
            if not live.accepted.set_running_or_notify_cancel():  # the submitter gave up already
                with self._lock:
                    self._live.pop(rid, None)
                continue
            try:
                self.engine.add_request(rid, prompt, sp, prompt_token_ids=ids,
                                        arrival_time=live.metrics.arrival)
            except ValueError as exc:
                self._refuse(rid, live, from_value_error(exc))
            except Exception as exc:
                logger.exception("add_request %s failed", rid)
                self._refuse(rid, live, RequestFailedError(f"internal error: {type(exc).__name__}"))
            else:
                live.accepted.set_result(live.stream)

    def _refuse(self, rid: str, live: _Live, err: ServingError) -> None:
        with self._lock:
            self._live.pop(rid, None)
        if not live.accepted.cancelled():
            live.accepted.set_exception(err)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            live = self._live.get(out.request_id)
        if live is None:
            return
        m = live.metrics
        m.prompt_tokens = len(out.prompt_token_ids)
        m.cached_tokens = out.num_cached_tokens
        total = sum(len(c.token_ids) for c in out.outputs)
        if total > live.completion_tokens:
            if m.first_token is None:
                m.first_token = now
            elif m.last_token is not None:
                m.itls.append(now - m.last_token)
            m.last_token = now
            live.completion_tokens = m.completion_tokens = total
        if out.error is not None:
            self._finish(out.request_id, live, now, "error", RequestFailedError(out.error))
        elif out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            live.stream._put(out)
            self._finish(out.request_id, live, now, reasons[0] if reasons else "abort", _END)
        else:
            live.stream._put(out)

    def _finish(self, rid: str, live: _Live, now: float, reason: str, last) -> None:
        with self._lock:
            self._live.pop(rid, None)
        m = live.metrics
        m.finished, m.finish_reason = now, reason
        logger.info("request %s finished=%s prompt_tokens=%d cached=%d completion_tokens=%d "
                    "ttft=%s e2e=%.3fs", rid, reason, m.prompt_tokens, m.cached_tokens,
                    m.completion_tokens, "-" if m.ttft is None else f"{m.ttft:.3f}s", m.e2e)
        for fn in self._done_listeners:
            try:
                fn(m)
            except Exception:
                logger.exception("request-done listener failed")
        live.stream._put(last)  # after the listeners: a client that saw the end sees its metrics

    def _fail_all(self, message: str) -> None:
        with self._lock:
            rids = list(self._live)
        if rids:
            try:
                self.engine.abort_request(rids)
                self.engine.step()  # flush the abort outputs
            except Exception:
                logger.exception("abort after failure raised")
        now = time.monotonic()
        for rid in rids:
            with self._lock:
                live = self._live.get(rid)
            if live is None:
                continue
            err = RequestFailedError(message)
            if not live.accepted.done():
                self._refuse(rid, live, err)
            else:
                self._finish(rid, live, now, "error", err)

    def _publish_stats(self) -> None:
        self._stats = self.engine.get_stats()
        for fn in self._stats_listeners:
            try:
                fn(self._stats)
            except Exception:
                logger.exception("stats listener failed")
