"""The engine in a process of its own, behind the interface `AsyncEngine` drives.

vLLM V1 runs its engine core in a separate process from the API server (thesis §4.2), so that
the front end's Python (HTTP parsing, one SSE chunk per client per step, tokenizing new
prompts) does not hold the GIL the engine loop needs between steps. With 256 streaming
clients a step's SSE work here is ~15 ms of CPU (`bench/http_stream.py`), all of it on the
engine's GIL when both run in one process.

`EngineProcess` spawns a child that builds the engine (`factory(*args)`: `load_engine` for
`pagedjax serve --engine-process`, a stub in tests) and then loops on its own: it applies
the commands the parent sent (admissions, aborts) between steps, steps while it has work,
and sends each step's outputs and stats back through a pipe. The parent's `step` returns
whatever outputs arrived since its last call, so the child never waits for the parent to
deliver them. What the front doors read from an engine besides that (the tokenizer, the
model's limits, `max_output_tokens`) comes once, in the child's first message.

The client requests that arrived since the child's last step are admitted in one message,
each all or none (`add_request_batches`, the rule of `AsyncEngine`'s in-process admission),
so a request's error still reaches its client as a 400 before any stream starts, and a burst
of clients waits one step, not one step each. Streams without beams go to
the engine as output kind "delta_ids": the engine never detokenizes them and the parent
decodes their ids (`_decode`). Their stop strings are found here as well, each sample's on
its own: a stopped sample is stopped in the child (`LLMEngine.stop_samples`), a request
whose last sample stopped is aborted there (`front_end_split`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import types
from collections.abc import Callable

from pagedjax.detokenizer import Detokenizer, DetokState
from pagedjax.input_processor import text_free_ok
from pagedjax.output_processor import OutputProcessor, top_entry
from pagedjax.outputs import CompletionOutput, RequestOutput, running_delta
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# An idle child waits this long for a command before looking at its engine's health again.
_IDLE_POLL_S = 0.05


def add_in_order(engine, items: list[tuple], params, strict_limits: bool = True
                 ) -> tuple[int, BaseException] | None:
    """Add one client request's sub-requests ``(rid, prompt, ids, arrival, output_kind[,
    priority])`` in order; on the first failure abort those added and return ``(index,
    exception)``."""
    added: list[str] = []
    for i, (rid, prompt, ids, arrival, kind, *rest) in enumerate(items):
        try:
            engine.add_request(rid, prompt, params, prompt_token_ids=ids, arrival_time=arrival,
                               strict_limits=strict_limits, output_kind=kind,
                               priority=rest[0] if rest else 0)
        except Exception as exc:  # ValueError: the client's fault; anything else: ours
            if not isinstance(exc, ValueError):
                logger.exception("add_request %s failed", rid)
            if added:  # no outputs: the client gets the error, and may reuse the ids at once
                engine.abort_request(added, withdraw=True)
            return i, exc
        added.append(rid)
    return None


class EngineError(RuntimeError):
    """An engine-side failure carried across the pipe; ``kind`` is the original type's name."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(kind, message)
        self.kind = kind


def _portable(exc: BaseException) -> BaseException:
    """An exception that survives pickling with its message: ValueErrors stay ValueErrors
    (the front doors turn them into 400s naming the field), anything else an `EngineError`."""
    if isinstance(exc, ValueError):
        return ValueError(str(exc))
    return EngineError(type(exc).__name__, str(exc))


def encode_outputs(outs: list, sent_prompts: set[str]) -> list[tuple]:
    """A step's `RequestOutput`s as plain tuples, which pickle ~6x faster than the slotted
    dataclasses (256 one-token outputs: 0.2 against 1.35 ms on the engine's side of the
    pipe). A request's prompt text and ids travel with its first output only. The engine
    makes some rows itself (`OutputProcessor.delta_row`, the same layout;
    tests/engine/test_pipe_rows.py holds the two equal)."""
    rows = []
    for o in outs:
        if type(o) is tuple:  # made as a row by the engine (`LLMEngine.pipe_rows`)
            if o[0] is not None and o[3]:  # (a `pipe_block`'s rows are running)
                sent_prompts.discard(o[0])
            rows.append(o)
            continue
        rid = o.request_id
        prompt = None
        if rid not in sent_prompts:
            prompt = (o.prompt, o.prompt_token_ids)
            sent_prompts.add(rid)
        if o.finished:
            sent_prompts.discard(rid)
        rows.append((rid, prompt, [(c.index, c.text, c.token_ids, c.cumulative_logprob,
                                    c.logprobs, c.finish_reason, c.stop_reason)
                                   for c in o.outputs],
                     o.finished, o.prompt_logprobs, o.num_cached_tokens, o.error,
                     o.first_scheduled_time))
    return rows


def decode_outputs(rows: list[tuple], prompts: dict[str, tuple]) -> list[RequestOutput]:
    """`encode_outputs`' inverse; ``prompts`` keeps each running request's prompt text and
    ids, and what its first output said of the fields a `pipe_block` leaves out (its first
    sequence's index, cached-token count, first scheduled time: fixed by then)."""
    outs = []
    for row in rows:
        if row[0] is None:
            _expand_block(row, prompts, outs)
            continue
        rid, prompt, comps, finished, prompt_lp, cached, error, scheduled = row
        if prompt is not None:
            prompts[rid] = (*prompt, comps[0][0] if comps else 0, cached, scheduled)
        text, ids = (prompts.pop(rid) if finished else prompts[rid])[:2]
        outs.append(RequestOutput(rid, text, ids, [CompletionOutput(*c) for c in comps],
                                  finished, prompt_lp, cached, error, scheduled))
    return outs


def _expand_block(block: tuple, prompts: dict[str, tuple], outs: list) -> None:
    """A `pipe_block`'s rows as the `RequestOutput`s `decode_outputs` makes of their
    `delta_row`s (`tests/engine/test_pipe_rows.py`): one running token each, and the
    logprob entry `OutputProcessor.listed_rows` would have made of the top-k columns."""
    _, rids, toks, lp = block
    if lp is None:
        for rid, tok in zip(rids, toks, strict=True):
            text, ids, index, cached, scheduled = prompts[rid]
            outs.append(running_delta(rid, text, ids, index, "", [tok], cached, scheduled))
        return
    cums, ks, tids, tlps, tlp = lp
    for j, rid in enumerate(rids):
        text, ids, index, cached, scheduled = prompts[rid]
        tok = toks[j]
        entry = top_entry(tids[j], tlps[j], ks[j])
        entry[tok] = tlp[j]
        outs.append(running_delta(rid, text, ids, index, "", [tok], cached, scheduled,
                                  cums[j], [entry]))


def _front_info(engine) -> dict:
    """What the front doors read from an engine other than its outputs (sent once)."""
    runner = getattr(engine, "runner", None)
    dtype = getattr(engine, "dtype", "float32")
    return {
        "model_name": engine.model_name,
        "dtype": getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype),
        "max_model_len": engine.max_model_len,
        "model_config": engine.model_config,
        "engine_config": engine.engine_config,
        "num_gpu_blocks": getattr(runner, "num_gpu_blocks", 0),
        "tokenizer": engine.tokenizer,
        "default_sampling": dict(getattr(engine, "default_sampling", None) or {}),
        # The engine's own input checks (`InputProcessor`, pure Python): prompt text limits and
        # `max_output_tokens` then need no round trip. A snapshot: servers pin no prefixes.
        "inputs": getattr(engine, "inputs", None),
        # Whether the engine streams text-free deltas, for the parent to decode.
        "text_free": "delta_ids" in getattr(engine, "output_kinds", ()),
        "stats": engine.get_stats(),
    }


def _child_main(conn, factory: Callable, args: tuple) -> None:
    """The engine process: build the engine, then apply commands and step until told to stop
    or the parent goes away."""
    try:
        engine = factory(*args)
        if hasattr(engine, "pipe_rows"):
            engine.pipe_rows = True  # its running deltas come as rows for `encode_outputs`
        conn.send(("ready", _front_info(engine)))
    except BaseException as exc:
        logger.exception("engine process failed to start")
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return
    applied = 0  # the last command applied: the parent's `has_unfinished_requests` needs it
    sent_prompts: set[str] = set()  # running requests whose prompt the parent has
    try:
        while True:
            busy = engine.has_unfinished_requests() or not getattr(engine, "healthy", True)
            if conn.poll(0 if busy else _IDLE_POLL_S):
                while True:  # every command that has arrived, then one step
                    cmd = conn.recv()
                    if cmd[0] == "stop":
                        return
                    applied = cmd[1]
                    if cmd[0] == "abort":
                        engine.abort_request(cmd[2], withdraw=cmd[3])
                    elif cmd[0] == "stop_samples":
                        engine.stop_samples(cmd[2])
                    elif cmd[0] == "reset_prefix_cache":
                        engine.reset_prefix_cache()
                    elif cmd[0] == "add":
                        results = [add_in_order(engine, items, params, cmd[3])
                                   for items, params in cmd[2]]
                        conn.send(("added", cmd[1], [None if r is None else
                                                     (r[0], _portable(r[1])) for r in results]))
                    if not conn.poll(0):
                        break
                busy = engine.has_unfinished_requests() or not getattr(engine, "healthy", True)
                if not busy:  # e.g. an abort of a finished request: say it was applied
                    conn.send(("step", [], engine.get_stats(), applied, False))
            if not busy:
                continue
            try:
                outs = engine.step()
            except Exception as exc:
                logger.exception("engine step raised")
                conn.send(("step_failed", f"{type(exc).__name__} in the engine process: {exc}",
                           applied))
                # As in one process: the front end fails and aborts its requests before the
                # next step, so wait for its word instead of failing again meanwhile.
                conn.poll(None)
                continue
            conn.send(("step", encode_outputs(outs, sent_prompts), engine.get_stats(), applied,
                       engine.has_unfinished_requests()))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone: so is every client


def front_end_split(params) -> tuple[SamplingParams, SamplingParams | None] | None:
    """How a streamed request runs text-free (output kind "delta_ids"): the params the engine
    gets, and the params whose stop strings the front end looks for (None: no stop strings).
    Stop strings move to the front end, each sample's on its own (the engine then needs no
    text). Beams, and best_of > n with stop strings, keep their text in the engine (None): the
    engine chooses their outputs at the end, by text it must have cut at the stops."""
    if not isinstance(params, SamplingParams):
        return None
    stops = None
    if (params.has_stop_strings and not params.use_beam_search
            and params.best_of in (None, params.n)):
        stops = params
        params = dataclasses.replace(params, stop=None, include_stop_str_in_output=False)
    return (params, stops) if text_free_ok(params) else None


class _FrontSeq:
    """One text-free sequence as the front end decodes it."""

    __slots__ = ("ids", "num_prompt", "state", "chars_sent")

    def __init__(self, prompt_ids: list[int]):
        n = len(prompt_ids)
        self.ids, self.num_prompt = list(prompt_ids), n
        self.state = DetokState(prefix_offset=max(0, n - 5), read_offset=n)
        self.chars_sent = 0

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.num_prompt

    def window(self, a: int, b: int) -> list[int]:
        return self.ids[a:b]


@dataclasses.dataclass
class _FrontText:
    """A text-free request: how to decode it, its stop strings, and which of its ``n``
    samples have ended."""

    skip: bool
    stops: SamplingParams | None
    n: int = 1
    seqs: dict[int, _FrontSeq] = dataclasses.field(default_factory=dict)
    ended: set[int] = dataclasses.field(default_factory=set)  # finished, here or in the child
    # Samples a stop string ended here while siblings run on: what the engine's later deltas
    # of a finished sample say (no text, no tokens), sent in place of the child's, whose
    # tokens past the stop are dropped.
    stopped: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)


class EngineDied(RuntimeError):
    """The engine process exited; every request in it is lost."""


class EngineProcess:
    """An engine in a spawned child process, with the methods and attributes `AsyncEngine`
    and the front doors use. ``factory(*args)`` runs in the child and returns the engine; it
    and its arguments must pickle (a module-level function, a class)."""

    def __init__(self, factory: Callable, *args, start_timeout_s: float = 1800.0,
                 step_wait_s: float = 0.05, decode_in_front: bool = True):
        ctx = mp.get_context("spawn")  # the child builds JAX's state from scratch, never forked
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, factory, args),
                                 name="pagedjax-engine-core", daemon=True)
        self._proc.start()
        child.close()
        self._step_wait_s = step_wait_s
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineDied(f"the engine process did not start in {start_timeout_s:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._proc.join(5.0)
            raise EngineDied(f"the engine process exited while starting (exit code "
                             f"{self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(5.0)
            raise EngineDied(f"the engine process failed to start: {info}")
        logger.info("engine process %d ready", self._proc.pid)
        self.model_name: str = info["model_name"]
        self.dtype: str = info["dtype"]
        self.max_model_len: int = info["max_model_len"]
        self.model_config = info["model_config"]
        self.engine_config = info["engine_config"]
        self.runner = types.SimpleNamespace(num_gpu_blocks=info["num_gpu_blocks"])
        self.tokenizer = info["tokenizer"]
        self.default_sampling: dict = info["default_sampling"]
        self.inputs = info["inputs"]
        self.structured = None  # grammars compile in the child (a bad one: a 400 from there)
        # Text-free streams ("delta_ids", `front_end_split`) are decoded here, off the
        # engine's process, with their stop strings: rid -> `_FrontText`.
        self._decode_here = bool(info.get("text_free")) and decode_in_front
        self._detok = Detokenizer(self.tokenizer) if self._decode_here else None
        self._texts: dict[str, _FrontText] = {}
        self._dropping: set[str] = set()  # stopped here, the child's abort output not seen yet
        self.num_front_stops = 0  # streams a stop string ended here, before the child's end
        self.num_front_sample_stops = 0  # samples of n > 1 streams stopped here, siblings on
        self._stats = info["stats"]
        self._send_lock = threading.Lock()
        self._cmd_ids = itertools.count(1)
        self._sent = 0  # the last command sent
        self._applied = 0  # the last command the child had applied at its latest step
        self._child_busy = False  # whether the child had work after its latest step
        self._outs: queue.SimpleQueue = queue.SimpleQueue()
        self._prompts: dict[str, tuple] = {}  # `decode_outputs`' prompts of running requests
        self._deferred: list = []  # messages after a failure `step` raised, for its next call
        self._join_lock = threading.Lock()  # the reader and `close` both wait for the child
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="pagedjax-engine-reader",
                                        daemon=True)
        self._reader.start()

    # ---- the child's messages (reader thread) --------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "added":
                    ev, box = self._replies.pop(msg[1])
                    box.append(msg[2])
                    ev.set()
                else:
                    self._outs.put(msg)
        except (EOFError, OSError):
            pass
        with self._join_lock:
            self._proc.join(5.0)
        self._dead = f"the engine process exited (exit code {self._proc.exitcode})"
        self._outs.put(("died",))
        for ev, _box in list(self._replies.values()):
            ev.set()  # an empty box: the admission fails with `EngineDied`

    def _send(self, msg_kind: str, *payload, reply: tuple | None = None) -> int:
        """Send one command; ``reply`` (an event and a list) is registered for its answer
        before the child can see the command."""
        if self._dead is not None:
            raise EngineDied(self._dead)
        with self._send_lock:
            cid = next(self._cmd_ids)
            if reply is not None:
                self._replies[cid] = reply
            try:
                self._conn.send((msg_kind, cid, *payload))
            except (BrokenPipeError, OSError) as exc:
                self._replies.pop(cid, None)
                raise EngineDied(f"the engine process is gone: {exc}") from None
            self._sent = cid
        return cid

    # ---- what AsyncEngine calls ----------------------------------------------
    def add_request_batches(self, batches: list[tuple[list[tuple], object]],
                            strict_limits: bool = True
                            ) -> list[tuple[int, BaseException] | None]:
        """`add_in_order` in the child for each ``(items, params)``: every client request
        queued since the last step, in one round trip."""
        if self._decode_here:
            batches = [self._text_free(items, params) for items, params in batches]
        ev, box = threading.Event(), []
        try:
            self._send("add", batches, strict_limits, reply=(ev, box))
        except EngineDied as exc:
            return [(0, exc)] * len(batches)
        ev.wait()
        if not box:
            exc = EngineDied(self._dead or "the engine process is gone")
            return [(0, exc)] * len(batches)
        for (items, _), failed in zip(batches, box[0]):
            if failed is not None:  # none of them runs
                for item in items:
                    self._texts.pop(item[0], None)
        return box[0]

    def _text_free(self, items: list[tuple], params) -> tuple[list[tuple], object]:
        """Delta requests that may stream without text go as "delta_ids" and are decoded
        here (`_decode`). Their stop strings are looked for here too, each sample's: the
        child gets the request without them."""
        split = front_end_split(params)
        if split is None or any(item[4] != "delta" for item in items):
            return items, params
        child, stops = split
        for rid, *_ in items:
            self._texts[rid] = _FrontText(child.skip_special_tokens, stops, child.n)
        return [(rid, prompt, ids, arrival, "delta_ids", *rest)
                for rid, prompt, ids, arrival, _, *rest in items], child

    def _decode(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The text of text-free deltas, decoded incrementally as the engine would have: one
        batched `Detokenizer.step` over every sequence that got tokens, then stop strings,
        then what is left of each finished sequence; each output's text is what became
        visible since the last (`OutputProcessor._delta`'s rule: while a sequence runs with
        stop strings, the last ``longest_stop - 1`` characters wait).

        A stop string found here ends its sample. While siblings run on, the child is told
        to stop that sample (`LLMEngine.stop_samples`) and its tokens past the stop are
        dropped here; the sample's later deltas say what the engine's would (finished, no
        new text). Once every sample has ended, here or in the child, the request ends
        here with that output and is aborted in the child, whose later outputs for it are
        dropped up to its end."""
        kept, items, seqs_out, sample_stops, running = [], [], [], [], []
        for o in outs:
            rid = o.request_id
            if rid in self._dropping:  # stopped here already: the child's tokens past the stop
                if o.finished:
                    self._dropping.discard(rid)
                continue
            kept.append(o)
            front = self._texts.get(rid)
            if front is None:
                continue
            if front.stopped:  # a fresh copy each time: consumers may extend its lists
                o.outputs = [c if (s := front.stopped.get(c.index)) is None else
                             dataclasses.replace(s, token_ids=[], logprobs=None
                                                 if s.logprobs is None else [])
                             for c in o.outputs]
            for c in o.outputs:
                if c.index in front.stopped:
                    continue
                if c.finish_reason is not None:
                    front.ended.add(c.index)
                seq = front.seqs.get(c.index)
                if seq is None:
                    seq = front.seqs[c.index] = _FrontSeq(o.prompt_token_ids)
                seq.ids.extend(c.token_ids)
                if c.token_ids:
                    items.append((seq.window, len(seq.ids), seq.state, front.skip))
                seqs_out.append((o, c, front, seq, seq.state.length))
            if o.finished:
                del self._texts[rid]
            else:
                running.append((o, front))
        if items:
            self._detok.step(items)
        for o, c, front, seq, old in seqs_out:
            p, state = front.stops, seq.state
            hit = None
            if p is not None and seq.num_output >= p.min_tokens and c.finish_reason in (
                    None, "length"):  # a stop string wins over a length limit (vLLM's order)
                hit = OutputProcessor.find_stop(state, p, old)
                if hit is not None:
                    c.finish_reason, c.stop_reason = "stop", hit
                    front.ended.add(c.index)
                    if not o.finished:
                        front.stopped[c.index] = CompletionOutput(
                            c.index, "", [], c.cumulative_logprob,
                            None if c.logprobs is None else [], "stop", hit)
                        sample_stops.append((o.request_id, c.index, hit))
            if hit is None and c.finish_reason not in (None, "abort"):  # as the engine: an
                self._detok.flush(seq.window, len(seq.ids), state, front.skip)  # abort keeps
                # a partial character back
            visible = state.length
            text = state.tail(seq.chars_sent)
            if p is not None and c.finish_reason is None:
                visible = max(seq.chars_sent, visible - p.longest_stop + 1)
                text = text[:visible - seq.chars_sent]
            c.text, seq.chars_sent = text, visible
        # Every sample ended, one or more by a stop string here: the request ends with this
        # output, as in the engine (its siblings' ends may have come with this output or
        # before), and is aborted in the child, whose outputs for it are dropped up to its
        # end. Its samples stopped in this batch need no word of their own.
        for o, front in running:
            if front.stopped and len(front.ended) >= front.n:
                rid = o.request_id
                self.num_front_stops += 1
                o.finished = True
                self._texts.pop(rid, None)
                self._dropping.add(rid)
                self.abort_request(rid)
        sample_stops = [s for s in sample_stops if s[0] not in self._dropping]
        if sample_stops and self._dead is None:
            self.num_front_sample_stops += len(sample_stops)
            try:
                self._send("stop_samples", sample_stops)
            except EngineDied:
                pass
        return kept

    def add_request(self, request_id: str, prompt, params=None, prompt_token_ids=None,
                    arrival_time: float | None = None, output_kind: str = "cumulative",
                    strict_limits: bool = False, priority: int = 0) -> None:
        arrival = time.monotonic() if arrival_time is None else arrival_time
        failed = self.add_request_batches(
            [([(request_id, prompt, prompt_token_ids, arrival, output_kind, priority)], params)],
            strict_limits)[0]
        if failed is not None:
            raise failed[1]

    def abort_request(self, request_id, withdraw: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self._dead is None:
            try:
                self._send("abort", ids, withdraw)
            except EngineDied:
                pass

    def reset_prefix_cache(self) -> bool:
        """Sent to the child, which applies it before any command sent after it."""
        self._send("reset_prefix_cache")
        return True

    def has_unfinished_requests(self) -> bool:
        queued = bool(self._deferred) or not self._outs.empty()
        if self._dead is not None:
            return queued
        return queued or self._child_busy or self._sent > self._applied

    def step(self) -> list:
        """The outputs of every step the child finished since the last call (waiting up to
        `step_wait_s` for one)."""
        msgs, self._deferred = self._deferred, []
        if not msgs:
            try:
                msgs = [self._outs.get(timeout=self._step_wait_s)]
            except queue.Empty:
                return []
        while True:
            try:
                msgs.append(self._outs.get_nowait())
            except queue.Empty:
                break
        outs: list = []
        for i, msg in enumerate(msgs):
            if msg[0] == "step":
                got = decode_outputs(msg[1], self._prompts)
                if self._texts or self._dropping:
                    got = self._decode(got)
                outs += got
                self._stats, self._applied, self._child_busy = msg[2], msg[3], msg[4]
                continue
            if outs:  # deliver what came before the failure first; it is raised next call
                self._deferred = msgs[i:]
                return outs
            if msg[0] == "step_failed":
                self._applied, self._child_busy = msg[2], False  # the child waits for us
                self._deferred = msgs[i + 1:]
                raise RuntimeError(msg[1])
            self._child_busy = False  # "died"
            raise EngineDied(self._dead or "the engine process exited")
        return outs

    def get_stats(self):
        if self._dead is not None and hasattr(self._stats, "healthy"):
            try:
                self._stats.healthy = False
            except AttributeError:
                pass
        return self._stats

    @property
    def unhealthy_reason(self) -> str | None:
        """Why new requests are refused, once the child is gone (else None)."""
        return None if self._dead is None else f"{self._dead}; the server must be restarted"

    @property
    def healthy(self) -> bool:
        return self._dead is None and bool(getattr(self._stats, "healthy", True))

    # ---- checks the front doors run before queueing ---------------------------
    def check_prompt_text(self, prompt, field: str = "prompt") -> None:
        if self.inputs is not None:
            self.inputs.check_prompt_text(prompt, field)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{field}: expected a non-empty prompt")

    def max_output_tokens(self, prompt_len: int, samples: int = 1) -> int:
        if self.inputs is not None:
            return self.inputs.max_output_tokens(prompt_len, samples)
        return max(0, self.max_model_len - prompt_len)

    # ---- lifecycle ------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Stop the child (it drops whatever it still runs) and wait for it."""
        if self._dead is None:
            try:
                self._send("stop")
            except EngineDied:
                pass
        with self._join_lock:
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                logger.warning("engine process did not stop in %.0f s: killing it", timeout_s)
                self._proc.kill()
                self._proc.join(5.0)
        self._conn.close()
        return self._proc.exitcode
