"""gRPC server (grpc.aio) over one `AsyncEngine`, with health, reflection and Prometheus metrics.

Lifecycle: bind the port and report NOT_SERVING → load the model and warm up (compile the
smallest shapes) → SERVING → on SIGTERM/SIGINT: NOT_SERVING, refuse new requests, let in-flight
ones finish for `grace_s`, abort the rest, stop, exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import uuid
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pagedjax.input_processor import MAX_REQUEST_ID_CHARS  # labels: bounded as engine ids
from pagedjax.serving.async_engine import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    AsyncEngine,
    DeltaTracker,
    merge_output,
    to_params,
)
from pagedjax.serving.auth import ApiKeyInterceptor
from pagedjax.serving.convert import delta_to_proto, params_from_proto
from pagedjax.serving.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    NotReadyError,
    ServingError,
    UnknownRequestError,
)
from pagedjax.serving.http_limits import HttpLimits
from pagedjax.serving.metrics import ServingMetrics
from pagedjax.serving.proto import pagedjax_pb2 as pb
from pagedjax.serving.proto import pagedjax_pb2_grpc as pb_grpc

logger = logging.getLogger("pagedjax.serving")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PagedJax"].full_name
GRPC_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unimplemented": grpc.StatusCode.UNIMPLEMENTED,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}


DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclasses.dataclass
class ServerOptions:
    model: str = "smollm2"
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int | None = 50051  # gRPC (`serve --grpc-port`); None: off
    metrics_port: int | None = None  # a separate metrics port; None: /metrics on HTTP only
    http_port: int | None = None  # OpenAI front door (`serve --port`); None: off
    served_model_name: str | None = None  # the name clients use (default: the model argument)
    tokenizer: str | None = None  # a tokenizer other than the model's
    chat_template: str | None = None  # a Jinja chat template, or a file holding one
    # Default sampling parameters of requests that leave them unset: "auto" (the model's
    # generation_config.json), "vllm" (none: vLLM's own defaults), or a folder holding one.
    generation_config: str = "auto"
    # tool_choice "auto": parse tool calls out of chat outputs with this family's parser
    # (`pagedjax.serving.tools.TOOL_PARSERS`); None: "auto" is refused with a 400.
    tool_call_parser: str | None = None
    # vLLM's `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details` with the
    # prompt tokens served from the prefix cache (`cached_tokens`), as OpenAI's API reports.
    enable_prompt_tokens_details: bool = False
    # Requests accepted but without a first token yet; more get RESOURCE_EXHAUSTED / HTTP 429
    # instead of an unbounded queue (None: unlimited).
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    grace_s: float = 30.0
    port_file: str | None = None  # JSON with the bound ports, written once listening
    api_key: str | None = None  # None: no authentication (see pagedjax/serving/auth.py)
    # Sequences (prompts x n/best_of) one client request may start (None: unlimited).
    max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # Timeouts, body size and connection caps of the HTTP and metrics ports (http_limits.py).
    http_limits: HttpLimits = dataclasses.field(default_factory=HttpLimits)
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    # Run the engine in a child process (`EngineProcess`), off the front doors' GIL.
    engine_process: bool = False


class Undecodable:
    """Stands in for request bytes that do not parse as the method's message, so the handler
    can answer INVALID_ARGUMENT (a deserializer that raises makes grpc answer UNKNOWN)."""

    def __init__(self, message: str, error: str):
        self.message, self.error = message, error


def _tolerant_parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return Undecodable(message_cls.DESCRIPTOR.name, str(e))
    return parse


def add_servicer(servicer: PagedJaxServicer, server) -> None:
    """`add_PagedJaxServicer_to_server`, with request parsing that never raises (above)."""
    methods = {
        "Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest, pb.GenerateResponse),
        "Abort": (grpc.unary_unary_rpc_method_handler, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": (grpc.unary_unary_rpc_method_handler, pb.ModelInfoRequest, pb.ModelInfo),
        "GetStats": (grpc.unary_unary_rpc_method_handler, pb.StatsRequest, pb.Stats),
    }
    handlers = {name: make(getattr(servicer, name), request_deserializer=_tolerant_parser(req),
                           response_serializer=resp.SerializeToString)
                for name, (make, req, resp) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class PagedJaxServicer(pb_grpc.PagedJaxServicer):
    """RPC handlers; `aengine` stays None until the model is loaded (→ UNAVAILABLE)."""

    def __init__(self):
        self.aengine: AsyncEngine | None = None
        # Engine request ids are the server's own ("grpc-<uuid>"); a client's `request_id` is a
        # label scoped to its connection (`context.peer()`): one client can neither abort nor
        # probe (by a duplicate-id error) another client's requests, on gRPC or HTTP.
        self._labels: dict[tuple[str, str], str] = {}

    async def _fail(self, context, err: ServingError):
        await context.abort(GRPC_CODES.get(err.kind, grpc.StatusCode.INTERNAL), err.message)

    async def _engine(self, context, request=None) -> AsyncEngine:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {request.message} ({request.error})")
        if self.aengine is None:
            await self._fail(context, NotReadyError("model is loading"))
        return self.aengine

    async def Generate(self, request: pb.GenerateRequest, context):
        aeng = await self._engine(context, request)
        rid = f"grpc-{uuid.uuid4().hex}"
        label = request.request_id or rid
        if len(label) > MAX_REQUEST_ID_CHARS or not label.isprintable():
            await self._fail(context, InvalidRequestError(
                f"request_id: must be at most {MAX_REQUEST_ID_CHARS} printable characters",
                "request_id"))
        key = (context.peer(), label)
        if key in self._labels:
            await self._fail(context, DuplicateRequestError(
                f"request_id: {label!r} is already in flight", "request_id"))
        which = request.WhichOneof("input")
        prompt = request.prompt if which == "prompt" else None
        ids = list(request.prompt_token_ids.ids) if which == "prompt_token_ids" else None
        self._labels[key] = rid
        stream = None
        try:
            try:
                sp = to_params({**getattr(aeng.engine, "default_sampling", {}),
                                **params_from_proto(request.params)})
                if ids is None:  # sized and checked first, then tokenized off the event loop
                    ids = await asyncio.to_thread(_checked_ids, aeng.engine, prompt)
                # Delta outputs: the engine's work per step stays what the new tokens cost.
                stream = await aeng.add_request_async(rid, prompt, sp, ids, delta=True,
                                                      priority=request.priority)
            except ServingError as err:
                logger.info("request %s refused: %s: %s", rid, err.kind, err.message)
                await self._fail(context, err)
            tracker = DeltaTracker(sp, delta=True)
            final = None
            async for out in stream:
                if request.stream:
                    deltas = tracker.update(out)
                    if deltas or out.finished:
                        yield _response(label, out, deltas)
                else:  # one response: the whole result, accumulated
                    final = out if final is None else merge_output(final, out)
            if not request.stream and final is not None:
                yield _response(label, final, tracker.update(final))
        except ServingError as err:
            await self._fail(context, err)
        finally:
            self._labels.pop(key, None)
            if stream is not None and not stream.finished:  # cancelled or deadline expired
                logger.info("request %s cancelled by the client", rid)
                aeng.abort(rid)

    async def Abort(self, request: pb.AbortRequest, context):
        """Aborts the caller's own requests, named by the ids it gave them; ids of other
        connections are unknown here (NOT_FOUND), as are finished ones."""
        aeng = await self._engine(context, request)
        aborted, unknown = [], []
        peer = context.peer()
        for label in request.request_ids:
            rid = self._labels.get((peer, label))
            (aborted if rid is not None and aeng.abort(rid) else unknown).append(label)
        if unknown and not aborted:
            await self._fail(context, UnknownRequestError(f"request_ids: not in flight: {unknown}",
                                                          "request_ids"))
        return pb.AbortResponse(aborted=aborted)

    async def GetModelInfo(self, request, context):
        eng = (await self._engine(context, request)).engine
        ec = eng.engine_config
        return pb.ModelInfo(model=eng.model_name, dtype=np.dtype(eng.dtype).name,
                            max_model_len=eng.max_model_len, block_size=ec.block_size,
                            num_gpu_blocks=eng.runner.num_gpu_blocks,
                            tensor_parallel_size=ec.tensor_parallel_size,
                            vocab_size=eng.model_config.vocab_size, max_num_seqs=ec.max_num_seqs)

    async def GetStats(self, request, context):
        aeng = await self._engine(context, request)
        s = aeng.get_stats()
        return pb.Stats(num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
                        num_gpu_blocks=s.num_gpu_blocks, num_free_gpu_blocks=s.num_free_gpu_blocks,
                        kv_cache_usage=s.kv_cache_usage, num_preemptions_total=s.num_preemptions_total,
                        num_steps=s.num_steps, prompt_tokens_total=s.prompt_tokens_total,
                        generation_tokens_total=s.generation_tokens_total,
                        num_in_flight=aeng.num_in_flight(), num_compiles=getattr(s, "num_compiles", 0),
                        spec_num_draft_tokens=getattr(s, "spec_num_draft_tokens", 0),
                        spec_num_accepted_tokens=getattr(s, "spec_num_accepted_tokens", 0),
                        spec_num_drafts=getattr(s, "spec_num_drafts", 0),
                        spec_accepted_per_position=list(getattr(s, "spec_accepted_per_position", ())),
                        spec_drafted_per_position=list(getattr(s, "spec_drafted_per_position", ())))


def _checked_ids(engine, prompt: str) -> list[int]:
    try:
        engine.check_prompt_text(prompt)
    except ValueError as e:
        raise InvalidRequestError(str(e), "prompt") from None
    return engine.tokenizer(prompt).input_ids


def _response(rid: str, out, deltas) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, outputs=[delta_to_proto(d) for d in deltas],
                               prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                               finished=out.finished)


def load_engine(opts: ServerOptions):
    """Load the model and compile the smallest shapes so the first client does not pay for it."""
    from pagedjax.engine import LLMEngine
    from pagedjax.sampling_params import SamplingParams

    eng = LLMEngine.from_model(opts.model, opts.dtype, tokenizer=opts.tokenizer,
                               chat_template=opts.chat_template,
                               served_model_name=opts.served_model_name, **opts.engine_kwargs)
    eng.default_sampling = generation_defaults(opts.generation_config, opts.model)
    if eng.default_sampling:
        logger.info("default sampling parameters from generation_config.json: %s",
                    eng.default_sampling)
    eng.add_request("warmup", "Hello", SamplingParams(max_tokens=2, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    eng.freeze_gc()  # loaded and warm: what is alive now lives as long as the server
    return eng


# generation_config.json keys that are sampling defaults, and their `SamplingParams` names.
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


def generation_defaults(choice: str, model: str) -> dict:
    """Sampling defaults as vLLM's `--generation-config` takes them: "auto" reads the model
    folder's generation_config.json (nothing for GGUF files and packaged names), "vllm" uses
    none, any other value is a folder holding the file. Only the sampling keys vLLM honours
    (temperature, top_p, top_k, min_p, repetition_penalty) are kept, and only
    when the file samples (`do_sample` not false)."""
    if choice == "vllm":
        return {}
    folder = Path(model) if choice == "auto" else Path(choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {choice!r}")
        return {}
    cfg = json.loads(path.read_text())
    if cfg.get("do_sample") is False:
        return {}
    return {ours: cfg[key] for key, ours in _GENERATION_KEYS.items() if cfg.get(key) is not None}


async def _set_health(health: HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The servers' event loop: uvloop's (a dependency except on Windows), as `vllm serve`
    runs, unless ``PAGEDJAX_UVLOOP=0``; else asyncio's. With 256 SSE clients on a stubbed
    engine the engine thread, which shares the GIL with the loop, waited 0.90 ms between
    steps against 2.57 (p99 3.2 against 6.4) and the clients finished 8 % sooner, for about
    the same CPU (`bench/http_stream.py`)."""
    if os.environ.get("PAGEDJAX_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def run_server(opts: ServerOptions, engine=None, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, when given: no signal handlers then).

    `engine` skips loading (tests, embedding)."""
    loop = asyncio.get_running_loop()
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(opts.api_key)] if opts.api_key else None)
    servicer = PagedJaxServicer()
    health = HealthServicer()
    add_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"]
                                         .full_name, reflection.SERVICE_NAME], server)
    ports = {}
    port = None
    if opts.port is not None:
        port = server.add_insecure_port(f"{opts.host}:{opts.port}")
        ports["port"] = ports["grpc_port"] = port
    await _set_health(health, False)
    await server.start()
    metrics = ServingMetrics()
    if opts.metrics_port is not None:
        ports["metrics_port"] = await metrics.serve(opts.metrics_port, opts.host, opts.http_limits)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    http = None
    if opts.http_port is not None:
        from pagedjax.serving.http import HttpFrontDoor
        from pagedjax.serving.tools import make_parser

        http = HttpFrontDoor(metrics.registry, opts.host, opts.http_port, api_key=opts.api_key,
                             limits=opts.http_limits,
                             tool_parser=make_parser(opts.tool_call_parser),
                             prompt_tokens_details=opts.enable_prompt_tokens_details)
        ports["http_port"] = await http.start()
    if opts.port_file:
        # Atomically: a reader polling for the file never sees it empty or half-written.
        tmp = Path(f"{opts.port_file}.tmp")
        tmp.write_text(json.dumps(ports))
        tmp.replace(opts.port_file)
    logger.info("listening on %s (%s); loading %s", opts.host, ports, opts.model)
    try:
        if engine is not None:
            eng = engine
        elif opts.engine_process:
            from pagedjax.serving.engine_process import EngineProcess

            eng = await loop.run_in_executor(None, EngineProcess, load_engine, opts)
        else:
            eng = await loop.run_in_executor(None, load_engine, opts)
    except Exception:
        logger.exception("failed to load the model")
        await server.stop(0)
        if http is not None:
            await http.stop()
        await metrics.close()
        return 1
    aengine = AsyncEngine(eng, max_waiting_requests=opts.max_waiting_requests,
                          max_sequences_per_request=opts.max_sequences_per_request)

    def health_changed(ok: bool) -> None:  # engine thread: NOT_SERVING while a cache rebuilds
        loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(_set_health(health, ok and aengine.accepting)))

    aengine.on_health(health_changed)
    aengine.start()
    metrics.attach(aengine)
    servicer.aengine = aengine
    if http is not None:
        http.set_engine(aengine)
    await _set_health(health, True)
    logger.info("serving %s", eng.model_name)
    await stop.wait()
    logger.info("shutting down: draining %d in-flight requests (grace %.1fs)", aengine.num_in_flight(),
                opts.grace_s)
    aengine.stop_accepting()
    await _set_health(health, False)
    aborted = await loop.run_in_executor(None, aengine.drain, opts.grace_s)
    logger.info("drained; %d requests aborted", aborted)
    await server.stop(1.0)
    if http is not None:
        await http.stop()
    aengine.shutdown()
    if engine is None and hasattr(eng, "close"):  # the engine process we started
        await loop.run_in_executor(None, eng.close)
    await metrics.close()
    return 0
