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
from collections.abc import Callable, Iterable, Iterator

from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.engine_process import EngineDied, add_in_order
from pagedjax.serving.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NotReadyError,
    QueueFullError,
    RequestFailedError,
    ServingError,
    UnsupportedError,
    from_value_error,
)

logger = logging.getLogger("pagedjax.serving")

# Sequences (prompts x n/best_of) one client request may start; more is refused up front.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
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
    scheduled: float | None = None  # first scheduled by the engine
    max_tokens: int | None = None  # the request's max_tokens (after defaults)

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else max(0.0, self.scheduled - self.arrival)

    # vLLM's phases of a request: prefill (first scheduled -> first token), decode (first ->
    # last token), inference (first scheduled -> last token = prefill + decode). The last
    # token is the finish of a request that ends by stop or length.
    @property
    def prefill_time(self) -> float | None:
        if self.scheduled is None or self.first_token is None:
            return None
        return max(0.0, self.first_token - self.scheduled)

    @property
    def decode_time(self) -> float | None:
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token

    @property
    def inference_time(self) -> float | None:
        prefill, decode = self.prefill_time, self.decode_time
        return None if prefill is None or decode is None else prefill + decode

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

    Items are cumulative `RequestOutput`s, or with ``delta`` (output_kind "delta", what the
    servers use) each item holds only what is new since the previous item; iteration ends
    after the finished one and raises `RequestFailedError` if the engine failed the request.

    Bounded: an unfinished output the consumer has not taken yet absorbs the next one, so a
    slow client holds at most one pending output plus the terminal items, whatever the
    generation length, and simply sees larger deltas — backpressure without blocking the
    engine thread. A cumulative output is replaced (it carries the whole result so far); a
    delta is extended in place (`merge_output`), which costs what the new tokens cost, so
    the engine thread's work per step does not grow with the output's length.
    """

    def __init__(self, request_id: str, aloop: asyncio.AbstractEventLoop | None = None,
                 delta: bool = False):
        self.request_id = request_id
        self.delta = delta
        self._aloop = aloop
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._tready = threading.Event()
        self._aready: asyncio.Event | None = asyncio.Event() if aloop is not None else None
        self.finished = False
        self.coalesced = 0  # outputs replaced before the consumer took them

    def _put(self, item, wake: bool = True) -> None:  # engine thread
        """Queue ``item``; ``wake=False`` leaves waking the consumer to the caller, which then
        wakes a whole step's streams at once (`wake_streams`)."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if (isinstance(item, RequestOutput) and isinstance(last, RequestOutput)
                    and not last.finished):
                # Not taken yet, so still the stream's own to extend.
                self._pending[-1] = merge_output(last, item) if self.delta else item
                self.coalesced += 1
            else:
                self._pending.append(item)
        if wake:
            wake_streams((self,))

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


def _set_all(events: list[asyncio.Event]) -> None:
    for ev in events:
        ev.set()


def wake_streams(streams: Iterable[RequestStream]) -> None:
    """Wake the consumers of ``streams`` (each once, however often it appears): a thread's by
    its event, asyncio ones by one callback per event loop. Each `call_soon_threadsafe` writes
    to its loop's self-pipe, a system call that also wakes the loop's thread, which then
    competes for the GIL while the engine thread delivers the rest of the step. One per
    stream kept the engine thread 3.1 ms between 20 ms steps at 256 streams, against 0.73
    for one per loop (`bench/stream_delivery.py`)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for s in dict.fromkeys(streams):
        if s._aready is None:
            s._tready.set()
        else:
            by_loop.setdefault(s._aloop, []).append(s._aready)
    for aloop, events in by_loop.items():
        try:
            aloop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the clients' event loop is gone: nobody is listening
            pass


def merge_output(acc: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Extend `acc` in place with the delta output `new` of the same request (output_kind
    "delta"): per output index, text and tokens (and logprobs) appended, the latest
    cumulative logprob and finish and stop reasons kept. Returns `acc`. Accumulating a
    request's deltas from its first output gives its cumulative output."""
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:  # a sample seen for the first time
            c = dataclasses.replace(c, token_ids=list(c.token_ids),
                                    logprobs=None if c.logprobs is None else list(c.logprobs))
            acc.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if old.logprobs is None:
                old.logprobs = []
            old.logprobs.extend(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    acc.finished = new.finished
    acc.error = new.error
    acc.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        acc.prompt_logprobs = new.prompt_logprobs
    if acc.first_scheduled_time is None:
        acc.first_scheduled_time = new.first_scheduled_time
    return acc


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
    """Turns a request's outputs into deltas whose concatenation equals the final text.

    Cumulative outputs are diffed against what was sent; while a request with stop strings is
    running, the last `max(len(stop)) - 1` characters are held back: the engine truncates the
    text when a stop string completes, and text already sent could not be taken back. With
    ``delta`` the outputs are already deltas (output_kind "delta": the engine holds the stop
    strings' characters back itself) and pass through, counted.
    """

    def __init__(self, params: SamplingParams, delta: bool = False):
        stops = params.stop_strings
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._delta = delta
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}

    @property
    def completion_tokens(self) -> int:
        """Tokens passed on so far, over all output indices."""
        return sum(self._sent_tokens.values())

    def update(self, out: RequestOutput) -> list[Delta]:
        if self._delta:
            return self._pass(out)
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

    def _pass(self, out: RequestOutput) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            n = self._sent_tokens.get(c.index, 0) + len(c.token_ids)
            self._sent_tokens[c.index] = n
            deltas.append(Delta(c.index, c.text, list(c.token_ids),
                                None if c.logprobs is None else list(c.logprobs),
                                c.finish_reason, c.stop_reason, n, c.cumulative_logprob))
        return deltas


def _start(fut: concurrent.futures.Future) -> bool:
    """Mark an admission future running; False if it was cancelled or already refused."""
    try:
        return fut.set_running_or_notify_cancel()
    except RuntimeError:  # already finished (refused by a failure before admission)
        return False


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

    def __init__(self, engine, max_waiting_requests: int | None = None, idle_wait_s: float = 0.05,
                 max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES_PER_REQUEST):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_sequences_per_request = max_sequences_per_request
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
        self._refusal_listeners: list[Callable[[ServingError], None]] = []
        self._health_listeners: list[Callable[[bool], None]] = []
        self._healthy = True
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopping

    @property
    def serving(self) -> bool:
        """Accepting and the engine healthy: what /health and gRPC health report. False while
        a lost device KV cache is rebuilt (the engine retries every step)."""
        return self.accepting and self._healthy

    def on_health(self, fn: Callable[[bool], None]) -> None:
        """Register a callback run on the engine thread when the engine's health changes."""
        self._health_listeners.append(fn)

    def on_refused(self, fn: Callable[[ServingError], None]) -> None:
        """Register a callback run (on the refusing thread) for every refused request."""
        self._refusal_listeners.append(fn)

    def _refused(self, err: ServingError) -> ServingError:
        for fn in self._refusal_listeners:
            try:
                fn(err)
            except Exception:
                logger.exception("refusal listener failed")
        return err

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
               aloop: asyncio.AbstractEventLoop | None = None,
               delta: bool = False, priority: int = 0) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its stream once the engine accepted it.

        Errors known without the engine (duplicate id, queue full, draining, bad sampling
        params) raise `ServingError` here; prompt errors arrive through the future."""
        return self.submit_many([(request_id, prompt, prompt_token_ids)], params, aloop,
                                delta, priority)[0]

    def submit_many(self, items: list[tuple[str, str | None, list[int] | None]],
                    params: SamplingParams | dict | None,
                    aloop: asyncio.AbstractEventLoop | None = None, delta: bool = False,
                    priority: int = 0) -> list[concurrent.futures.Future]:
        """Queue the sub-requests of one client request (a list of prompts, one params) as a
        unit: the engine thread admits all of them between two steps or none (the first
        refusal refuses all), so a 1000-prompt request neither trickles in one prompt per step
        nor half-runs. At most `max_sequences_per_request` sequences (prompts x n/best_of).
        ``delta``: the streams carry delta outputs (`RequestStream`). ``priority``: the
        engine's `add_request` argument, for every sub-request (checked there)."""
        try:
            sp = to_params(params)
            structured = getattr(self.engine, "structured", None)
            if sp.guided_decoding is not None and structured is not None:
                # Compiled and validated here, on the caller's thread (the engine thread's
                # compile of the same grammar is then a cache hit); a bad schema is a 400.
                try:
                    structured.compile(sp.guided_decoding)
                except ValueError as exc:
                    raise from_value_error(exc) from None
            samples = sp.best_of or sp.n
            cap = self.max_sequences_per_request
            if cap is not None and len(items) * samples > cap:
                # The field to change: the prompt list, or the samples of a single prompt.
                field = "prompt" if len(items) > 1 else ("best_of" if sp.best_of != sp.n else "n")
                raise InvalidRequestError(
                    f"{field}: {len(items)} prompts x {samples} samples = {len(items) * samples} "
                    f"sequences exceed max_sequences_per_request={cap}", field)
            now = time.monotonic()
            lives = [_Live(RequestStream(rid, aloop, delta),
                           RequestMetrics(rid, now, max_tokens=sp.max_tokens),
                           concurrent.futures.Future()) for rid, _, _ in items]
            with self._lock:
                if not self.accepting:
                    raise NotReadyError("server is draining or stopped")
                if not self._healthy:
                    raise NotReadyError(getattr(self.engine, "unhealthy_reason", None)
                                        or "the engine is rebuilding its KV cache after a "
                                           "device failure; retry shortly")
                for rid, _, _ in items:
                    if rid in self._live:
                        raise DuplicateRequestError(f"request_id: {rid!r} is already in flight",
                                                    "request_id")
                if len({rid for rid, _, _ in items}) != len(items):
                    raise DuplicateRequestError("request_id: repeated within the request",
                                                "request_id")
                if self.max_waiting_requests is not None:
                    waiting = sum(1 for x in self._live.values() if x.metrics.first_token is None)
                    if waiting + len(items) > self.max_waiting_requests:
                        raise QueueFullError(
                            f"{waiting} requests waiting, {len(items)} more would exceed "
                            f"max_waiting_requests={self.max_waiting_requests}")
                for (rid, _, _), live in zip(items, lives):
                    self._live[rid] = live
        except ServingError as err:
            raise self._refused(err) from None
        self._cmds.put(("add", [(rid, prompt, ids, live) for (rid, prompt, ids), live
                                in zip(items, lives)], sp, priority))
        self._wake.set()
        return [live.accepted for live in lives]

    def add_request(self, request_id: str, prompt: str | None, params=None,
                    prompt_token_ids: list[int] | None = None,
                    priority: int = 0) -> RequestStream:
        """Blocking add from a thread; raises `ServingError` if the request is refused."""
        return self.submit(request_id, prompt, params, prompt_token_ids,
                           priority=priority).result()

    async def add_request_async(self, request_id: str, prompt: str | None, params=None,
                                prompt_token_ids: list[int] | None = None,
                                delta: bool = False, priority: int = 0) -> RequestStream:
        streams = await self.add_requests_async([(request_id, prompt, prompt_token_ids)], params,
                                                delta, priority)
        return streams[0]

    async def add_requests_async(self, items: list[tuple[str, str | None, list[int] | None]],
                                 params=None, delta: bool = False, priority: int = 0
                                 ) -> list[RequestStream]:
        """`submit_many` from asyncio: all streams once all are admitted."""
        futs = self.submit_many(items, params, asyncio.get_running_loop(), delta, priority)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futs)))
        except asyncio.CancelledError:  # the caller went away before the engine took them
            for rid, _, _ in items:
                self.abort(rid)
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

    async def reset_prefix_cache_async(self) -> bool:
        """Forget the engine's prefix cache (vLLM's `/reset_prefix_cache`), on the engine
        thread between two steps, after every command queued before it: requests submitted
        after this returns are computed in full."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("reset_prefix_cache", done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def get_stats(self):
        """The `EngineStats` published after the engine thread's latest step."""
        return self._stats

    # ---- engine thread -----------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            try:
                self._apply_commands()
            except Exception as exc:  # a last resort: this thread must outlive any bug
                logger.exception("applying client commands raised")
                self._fail_all(f"internal error: {type(exc).__name__}")
                continue
            # An unhealthy engine steps even when idle: `step` is where it retries rebuilding
            # its KV cache, and it refuses new requests until then.
            if not eng.has_unfinished_requests() and self._healthy:
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
            self._deliver_all(outs, now)
        self._fail_all("server stopped")

    def _apply_commands(self) -> None:
        cmds = []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        i = 0
        while i < len(cmds):  # in order; a run of admissions goes to the engine at once
            if cmds[i][0] == "abort":
                self.engine.abort_request(cmds[i][1])
                i += 1
                continue
            if cmds[i][0] == "reset_prefix_cache":
                done = cmds[i][1]
                try:
                    done.set_result(bool(self.engine.reset_prefix_cache()))
                except Exception as exc:  # the caller hears of it; serving goes on
                    logger.exception("resetting the prefix cache raised")
                    done.set_exception(exc)
                i += 1
                continue
            j = i
            while j < len(cmds) and cmds[j][0] == "add":
                j += 1
            self._admit([(c[1], c[2], c[3]) for c in cmds[i:j]])
            i = j

    def _admit(self, requests: list[tuple[list[tuple], SamplingParams, int]]) -> None:
        """Add client requests' sub-requests to the engine, each client request all or none.
        An engine in another process takes them all in one round trip (`EngineProcess`), so a
        burst of clients is admitted between two of its steps, not one client a step."""
        todo = []
        for batch, sp, priority in requests:
            with self._lock:
                present = all(self._live.get(rid) is live for rid, _, _, live in batch)
            # A submitter that gave up (or an abort that came first) withdraws the whole batch.
            started = [_start(live.accepted) for *_, live in batch]
            if not present or not all(started):
                self._refuse_all(batch, RequestFailedError("request withdrawn before admission"))
                continue
            items = [(rid, prompt, ids, live.metrics.arrival,
                      "delta" if live.stream.delta else "cumulative", priority)
                     for rid, prompt, ids, live in batch]
            todo.append((batch, items, sp))
        if not todo:
            return
        add_many = getattr(self.engine, "add_request_batches", None)
        if add_many is not None:
            results = add_many([(items, sp) for _, items, sp in todo], True)
        else:
            results = [add_in_order(self.engine, items, sp, True) for _, items, sp in todo]
        for (batch, _, _), failed in zip(todo, results):
            if failed is None:
                for *_, live in batch:
                    live.accepted.set_result(live.stream)
                continue
            i, exc = failed
            if isinstance(exc, ValueError):
                err = from_value_error(exc)
                if len(batch) > 1:
                    err.message += f" (prompt {i} of {len(batch)})"
            else:
                err = RequestFailedError(str(exc) if isinstance(exc, EngineDied) else
                                         f"internal error: {getattr(exc, 'kind', type(exc).__name__)}")
            self._refuse_all(batch, self._refused(err))

    def _refuse_all(self, batch: list[tuple], err: ServingError) -> None:
        for rid, _, _, live in batch:
            self._refuse(rid, live, err)

    def _refuse(self, rid: str, live: _Live, err: ServingError) -> None:
        with self._lock:
            if self._live.get(rid) is live:
                del self._live[rid]
        if not live.accepted.done():
            live.accepted.set_exception(err)

    def _deliver_all(self, outs: list[RequestOutput], now: float) -> None:
        """Hand a step's outputs to their streams, then wake the consumers: one lock for the
        lookups and one wake-up per event loop, not per output (`wake_streams`)."""
        with self._lock:
            lives = [self._live.get(out.request_id) for out in outs]
        woken: list[RequestStream] = []
        try:
            for out, live in zip(outs, lives):
                if live is None:
                    continue
                try:
                    self._deliver(out, live, now, woken)
                except Exception as exc:  # a bug with one request's output: that one only
                    logger.exception("delivering request %s's output raised", out.request_id)
                    self._fail_one(out.request_id, live, now, exc, woken)
        finally:  # a failing listener must not leave delivered items unseen
            wake_streams(woken)

    def _fail_one(self, rid: str, live: _Live, now: float, exc: Exception,
                  woken: list[RequestStream]) -> None:
        """End one stream whose delivery failed, with an internal error, and withdraw its
        request from the engine (no abort output: a client may reuse the id at once). The
        step's other streams and the engine thread go on."""
        try:
            self.engine.abort_request(rid, withdraw=True)
        except Exception:
            logger.exception("withdrawing request %s after its delivery failed raised", rid)
        err = RequestFailedError(f"internal error: {type(exc).__name__}")
        try:
            self._finish(rid, live, now, "error", err, woken)
        except Exception:
            logger.exception("ending request %s after its delivery failed raised", rid)
            with self._lock:
                if self._live.get(rid) is live:
                    del self._live[rid]
            live.stream._put(err, wake=False)
            woken.append(live.stream)

    def _deliver(self, out: RequestOutput, live: _Live, now: float,
                 woken: list[RequestStream]) -> None:
        m = live.metrics
        m.prompt_tokens = len(out.prompt_token_ids)
        m.cached_tokens = out.num_cached_tokens
        if m.scheduled is None and out.first_scheduled_time is not None:
            m.scheduled = out.first_scheduled_time
        total = sum(len(c.token_ids) for c in out.outputs)
        if live.stream.delta:  # this output's tokens are all new
            total += live.completion_tokens
        if total > live.completion_tokens:
            if m.first_token is None:
                m.first_token = now
            elif m.last_token is not None:
                m.itls.append(now - m.last_token)
            m.last_token = now
            live.completion_tokens = m.completion_tokens = total
        if out.error is not None:
            self._finish(out.request_id, live, now, "error", RequestFailedError(out.error),
                         woken)
        elif out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            live.stream._put(out, wake=False)
            self._finish(out.request_id, live, now, reasons[0] if reasons else "abort", _END,
                         woken)
        else:
            live.stream._put(out, wake=False)
            woken.append(live.stream)

    def _finish(self, rid: str, live: _Live, now: float, reason: str, last,
                woken: list[RequestStream] | None = None) -> None:
        """End a stream with ``last`` (the end marker or an error). With ``woken`` the
        consumer is woken later, with the step's other streams; without, at once."""
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
        # After the listeners: a client that saw the end sees its metrics.
        live.stream._put(last, wake=woken is None)
        if woken is not None:
            woken.append(live.stream)

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
        try:
            self._stats = self.engine.get_stats()
        except Exception:  # stats are not worth the engine thread: keep the last ones
            logger.exception("engine stats raised")
            return
        healthy = bool(getattr(self._stats, "healthy", True))
        if healthy != self._healthy:
            self._healthy = healthy
            logger.warning("engine %s", "healthy again" if healthy else "unhealthy: NOT_SERVING")
            for fn in self._health_listeners:
                try:
                    fn(healthy)
                except Exception:
                    logger.exception("health listener failed")
        for fn in self._stats_listeners:
            try:
                fn(self._stats)
            except Exception:
                logger.exception("stats listener failed")
