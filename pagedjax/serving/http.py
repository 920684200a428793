"""OpenAI-compatible HTTP front door (FastAPI + uvicorn) over the same `AsyncEngine` as gRPC.

Validation, queue limits, deltas and metrics all come from `AsyncEngine`/`ServingMetrics`; this
module only maps the OpenAI schema onto them and errors onto OpenAI's error JSON (never a stack
trace). Streaming uses server-sent events ending in `data: [DONE]`; a client that disconnects
mid-stream has its request aborted (blocks freed at the next step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.serving.async_engine import (
    AsyncEngine,
    DeltaTracker,
    RequestStream,
    merge_output,
    to_params,
)
from pagedjax.serving.auth import UNAUTHENTICATED_MESSAGE, bearer_ok
from pagedjax.serving.errors import InvalidRequestError, NotReadyError, ServingError
from pagedjax.serving.http_limits import BoundServer, HttpLimits
from pagedjax.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from pagedjax.serving.tools import (
    ToolDeltas,
    calls_from_constrained,
    check_tools,
    guided_for,
    openai_call_id,
    template_tools,
)

logger = logging.getLogger("pagedjax.serving.http")

HTTP_STATUS = {"invalid_argument": 400, "unimplemented": 400, "already_exists": 409, "not_found": 404,
               "resource_exhausted": 429, "unavailable": 503, "internal": 500}


class ModelNotFound(ServingError):
    kind = "not_found"


def sse_chunk(meta: dict, obj: str, choice: dict) -> str:
    """One SSE event of a streamed response: a chunk of one choice."""
    return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"


# Stands in for a choice's text while its event is split into a frame (`text_frame`).
_TEXT_SLOT = "\x00pagedjax-text\x00"


def running_choice(idx: int, text: str, chat: bool) -> dict:
    """A running choice's chunk without logprobs (a chat one past its first, without tools)."""
    if chat:
        return {"index": idx, "delta": {"content": text}, "logprobs": None,
                "finish_reason": None}
    return {"index": idx, "text": text, "logprobs": None, "finish_reason": None}


def text_frame(meta: dict, obj: str, idx: int, chat: bool) -> tuple[str, str]:
    """`sse_chunk` of `running_choice` split around its text, so that a running choice's
    event is ``head + json.dumps(text) + tail``: one string encoded a chunk instead of the
    whole chunk dictionary (json.dumps of a container encodes a string inside it as
    json.dumps of the string). Most events of a stream are such; the chunk's JSON was ~10 %
    of the event loop's time at 256 streams (`bench/http_stream.py`). The text is the last
    string of the chunk (the ids and the model name, which a client may set, come before
    it), so the last occurrence of the placeholder is it."""
    whole = sse_chunk(meta, obj, running_choice(idx, _TEXT_SLOT, chat))
    at = whole.rindex(json.dumps(_TEXT_SLOT))
    return whole[:at], whole[at + len(json.dumps(_TEXT_SLOT)):]


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


def _serving_error(err: ServingError) -> JSONResponse:
    status = HTTP_STATUS.get(err.kind, 500)
    type_ = "invalid_request_error" if status == 400 else err.kind
    return error_response(status, err.message, type_, err.field)


@dataclasses.dataclass
class _Job:
    """One engine request behind an OpenAI request (a list of prompts gives several)."""

    rid: str
    stream: RequestStream
    tracker: DeltaTracker
    offset: int  # choice index of this prompt's first sample


class _ApiKeyMiddleware:
    """`--api-key` on /v1 routes and /tokenize, /detokenize (/health, /metrics and /version
    stay open for probes and scrapers, as in vLLM). Plain ASGI rather than `@app.middleware`:
    Starlette's BaseHTTPMiddleware wraps `receive`, which hides client disconnects from the
    endpoints that poll for them."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in (
                "/tokenize", "/detokenize", "/reset_prefix_cache")):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not bearer_ok(auth, self.key):
                resp = error_response(401, UNAUTHENTICATED_MESSAGE, "authentication_error")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def dev_mode() -> bool:
    """Development endpoints on (`/reset_prefix_cache`), as vLLM's $VLLM_SERVER_DEV_MODE."""
    return "1" in (os.environ.get("PAGEDJAX_SERVER_DEV_MODE"), os.environ.get("VLLM_SERVER_DEV_MODE"))


def build_app(front: HttpFrontDoor) -> FastAPI:
    app = FastAPI(title="pagedjax OpenAI-compatible API", docs_url=None, redoc_url=None)
    if front.api_key:
        app.add_middleware(_ApiKeyMiddleware, key=front.api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        return error_response(400, f"{'.'.join(loc)}: {err.get('msg', 'invalid request')}",
                              "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        # Framework errors (a body that is not UTF-8, an unknown route, a wrong method) in the
        # OpenAI error shape rather than FastAPI's {"detail": ...}.
        type_ = "invalid_request_error" if exc.status_code == 400 else {
            404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(ServingError)
    async def _serving(_request, exc: ServingError):
        return _serving_error(exc)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, "internal server error", "internal")

    # The schema says what these really send (no body; Prometheus text), not FastAPI's JSON default.
    @app.get("/health", response_class=Response,
             responses={200: {"description": "serving"},
                        503: {"description": "loading, draining, or rebuilding a lost KV cache"}})
    async def health():  # 503 while loading, draining, or rebuilding a lost KV cache
        ok = front.aengine is not None and front.aengine.serving
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(front.registry), media_type=CONTENT_TYPE_LATEST)

    if dev_mode():
        @app.post("/reset_prefix_cache", response_class=Response)
        async def reset_prefix_cache():
            """vLLM's development endpoint: forget every cached block, so repeated benchmark
            prompts are computed again. Only with $PAGEDJAX_SERVER_DEV_MODE (or vLLM's
            $VLLM_SERVER_DEV_MODE) set to 1: any client could otherwise slow everyone's
            requests. Behind the API key when there is one."""
            front.engine()  # 503 while loading
            await asyncio.wait_for(front.aengine.reset_prefix_cache_async(), 60)
            return Response(status_code=200)

    @app.get("/version")
    async def version():
        from pagedjax import __version__

        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        front.check_model(body.model)
        eng = front.engine()
        tok = eng.tokenizer
        try:  # the tools as the chat template sees them (as vLLM's /tokenize takes them)
            funcs = check_tools(body.tools, "none")[0]
        except ValueError as e:
            raise InvalidRequestError(str(e), "tools") from None
        if funcs and body.messages is None:
            raise InvalidRequestError("tools: only with messages", "tools")

        def run() -> list[int]:  # off the event loop
            if body.messages is not None:
                conv = conversation(body.messages)
                front.check_text("".join(m["content"] for m in conv) or " ", "messages")
                extra = {"tools": template_tools(funcs)} if funcs else {}
                return _render_chat(tok, conv, body.add_generation_prompt, **extra)[1]
            front.check_text(body.prompt, "prompt")
            return tok(body.prompt, add_special_tokens=body.add_special_tokens).input_ids

        ids = await asyncio.to_thread(run)
        return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        front.check_model(body.model)
        eng = front.engine()
        vocab = eng.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"tokens: ids {bad[:5]} are not in [0, {vocab})", "tokens")
        text = await asyncio.to_thread(eng.tokenizer.decode, body.tokens)
        return {"prompt": text}

    @app.get("/v1/models")
    async def models():
        eng = front.engine()
        return {"object": "list", "data": [{"id": eng.model_name, "object": "model", "created": front.created,
                                            "owned_by": "pagedjax", "max_model_len": eng.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        front.check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("prompt: empty prompt list", "prompt")
        if body.echo or body.suffix:
            raise NotImplementedErrorHttp("echo" if body.echo else "suffix")
        texts = [p for p in prompts if isinstance(p, str)]
        for p in texts:  # sized and checked first, then tokenized together off the event loop
            front.check_text(p, "prompt")
        ids = iter(await asyncio.to_thread(front.tokenize, texts) if texts else [])
        jobs = [(p, next(ids)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        return await front.run(body, jobs, body.sampling_params(), chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        front.check_model(body.model)
        tok = front.engine().tokenizer
        conversation = body.conversation()
        front.check_text("".join(m["content"] for m in conversation) or " ", "messages")

        funcs, mode = body.tool_mode()
        if mode == "auto" and front.tool_parser is None:
            raise InvalidRequestError(
                "tool_choice: 'auto' needs the server started with --enable-auto-tool-choice "
                "and --tool-call-parser (or name a function, or use 'required')", "tool_choice")
        extra = {"tools": template_tools(funcs)} if funcs else {}  # shown even with "none", as vLLM

        text, ids = await asyncio.to_thread(_render_chat, tok, conversation, True, **extra)
        params = body.sampling_params()
        if "max_tokens" not in params:  # as long as the context and the KV cache allow
            samples = params.get("best_of") or params.get("n") or 1
            fit = front.engine().max_output_tokens(len(ids), samples) if isinstance(samples, int) else 1
            params["max_tokens"] = max(1, fit)
        tools = None
        if mode is not None:
            parser = front.tool_parser
            guide = guided_for(funcs, mode, parallel=body.parallel_tool_calls is not False)
            if guide is not None:  # a required or named call: valid by construction
                params["guided_decoding"] = guide
            if mode == "auto" and parser.keeps_special_tokens:  # its markers must stay
                params.setdefault("skip_special_tokens", False)
            # Ids in the style of the server's parser (Mistral's templates need 9 characters).
            tools = (mode, parser if mode == "auto" else None,
                     body.parallel_tool_calls is not False,
                     parser.call_id if parser is not None else openai_call_id)
        return await front.run(body, [(text, ids)], params, chat=True, request=request,
                               tools=tools)

    return app


class NotImplementedErrorHttp(ServingError):
    kind = "unimplemented"

    def __init__(self, field: str):
        super().__init__(f"{field}: not supported by this server", field)


class HttpFrontDoor:
    """Owns the uvicorn server; `set_engine` makes it ready once the model is loaded.
    `limits` bound what one client can hold open (header/body timeouts, body size,
    connections; see `http_limits.py`)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 api_key: str | None = None, limits: HttpLimits | None = None,
                 tool_parser=None, prompt_tokens_details: bool = False):
        self.registry = registry
        # usage.prompt_tokens_details.cached_tokens (serve --enable-prompt-tokens-details)
        self.prompt_tokens_details = prompt_tokens_details
        self.tool_parser = tool_parser  # `tool_choice: "auto"` (serve --enable-auto-tool-choice)
        self.api_key = api_key
        self.host, self.port = host, port
        self.limits = limits or HttpLimits()
        self.aengine: AsyncEngine | None = None
        self.created = int(time.time())
        self.app = build_app(self)
        self._server: BoundServer | None = None

    def set_engine(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine

    def engine(self):
        if self.aengine is None:
            raise NotReadyError("model is loading")
        return self.aengine.engine

    def check_model(self, model: str | None) -> None:
        name = self.engine().model_name
        if model and model not in (name, Path(name).name, Path(name).stem):
            raise ModelNotFound(f"model: {model!r} is not served here (serving {name!r})", "model")

    async def start(self) -> int:
        """Bind now (so the port is known), serve in a task; returns the bound port."""
        self._server = BoundServer(self.app, self.host, self.port, self.limits, grace_s=5)
        return await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()

    # ---- request handling ----------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several prompts in one tokenizer call (run off the event loop)."""
        tok = self.engine().tokenizer
        if len(texts) == 1:
            return [tok(texts[0]).input_ids]
        return list(tok(texts).input_ids)

    def check_text(self, text: str, field: str) -> None:
        """The engine's pre-tokenization checks (size, Unicode) as a 400 naming ``field``."""
        try:
            self.engine().check_prompt_text(text, field)
        except ValueError as e:
            raise InvalidRequestError(str(e), field) from None

    async def run(self, body, prompts: list[tuple[str | None, list[int] | None]], params: dict, chat: bool,
                  request: Request | None = None, tools: tuple | None = None):
        """``tools``: (mode, parser) of a chat request that may call tools (`tools.py`)."""
        if self.aengine is None:
            raise NotReadyError("model is loading")
        # `serve --generation-config` defaults for what the request leaves unset.
        sp = to_params({**getattr(self.engine(), "default_sampling", {}), **params})
        base = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # The client's id only labels the response: engine ids are the server's own, so no
        # client can collide with, probe or abort another's requests (gRPC included).
        internal = f"http-{uuid.uuid4().hex}"
        items = [(f"{internal}-{i}", text, ids) for i, (text, ids) in enumerate(prompts)]
        # All prompts are admitted together (or refused together); aborted together below.
        # Delta outputs: the engine's work per step stays what the new tokens cost.
        streams = await self.aengine.add_requests_async(items, sp, delta=True,
                                                        priority=body.priority)
        jobs = [_Job(rid, stream, DeltaTracker(sp, delta=True), i * sp.n)
                for i, ((rid, _, _), stream) in enumerate(zip(items, streams))]
        meta = {"id": base, "created": int(time.time()), "model": self.engine().model_name}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(self._sse(jobs, meta, chat, sp, include_usage, tools),
                                     media_type="text/event-stream")
        try:
            finals = await self._finals_unless_disconnected(jobs, request)
        finally:
            self._abort(jobs)  # a disconnected client's requests free their blocks
        if finals is None:  # nobody reads this; 499 is nginx's "client closed request"
            return Response(status_code=499)
        return self._full_response(jobs, finals, meta, chat, sp, tools)

    async def _finals_unless_disconnected(self, jobs: list[_Job], request: Request | None):
        """Final outputs of a non-streaming call; gives up as soon as the client goes away
        (nobody would read the answer: None then), polling the connection between outputs."""
        gathered = asyncio.ensure_future(asyncio.gather(*(self._final(j) for j in jobs)))
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=0.2)
                if done:
                    return gathered.result()
                if request is not None and await request.is_disconnected():
                    return None
        finally:
            if not gathered.done():
                gathered.cancel()

    def _abort(self, jobs: list[_Job]) -> None:
        for j in jobs:
            if not j.stream.finished:
                self.aengine.abort(j.rid)

    async def _final(self, job: _Job):
        """The request's whole result, accumulated from its delta outputs."""
        acc = None
        async for out in job.stream:
            acc = out if acc is None else merge_output(acc, out)
        return acc

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    def _full_response(self, jobs, finals, meta, chat: bool, sp, tools=None) -> dict:
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for job, out in zip(jobs, finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens or 0
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                idx = job.offset + c.index
                lp = (self._logprobs(c.token_ids, c.logprobs, chat, sp.logprobs)
                      if sp.logprobs is not None else None)
                if chat:
                    message, finish = _assistant_message(c.text, c.finish_reason, tools)
                    choices.append({"index": idx, "message": message, "logprobs": lp,
                                    "finish_reason": finish})
                else:
                    choices.append({"index": idx, "text": c.text, "logprobs": lp,
                                    "finish_reason": c.finish_reason})
        choices.sort(key=lambda c: c["index"])
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": self._usage(prompt_tokens, completion_tokens, cached)}

    async def _sse(self, jobs: list[_Job], meta: dict, chat: bool, sp, include_usage: bool,
                   tools=None) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for out in job.stream:
                    await queue.put((job, out, None))
            except ServingError as err:
                await queue.put((job, None, err))
            finally:
                await queue.put((job, None, None))

        obj = "chat.completion.chunk" if chat else "text_completion"
        frames: dict[int, tuple[str, str]] = {}  # choice index -> `text_frame`
        dumps = json.dumps
        tasks = [asyncio.create_task(pump(j)) for j in jobs]
        started: set[int] = set()
        calls: dict[int, ToolDeltas] = {}  # choice index -> its tool-call stream
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        counted: set[str] = set()
        done = 0
        try:
            while done < len(jobs):
                job, out, err = await queue.get()
                if err is not None:
                    body = {"error": {"message": err.message, "type": err.kind, "param": err.field,
                                      "code": HTTP_STATUS.get(err.kind, 500)}}
                    yield f"data: {json.dumps(body)}\n\n"
                    continue
                if out is None:
                    done += 1
                    continue
                for d in job.tracker.update(out):
                    idx = job.offset + d.index
                    lp = (self._logprobs(d.token_ids, d.logprobs, chat, sp.logprobs)
                          if sp.logprobs is not None and d.logprobs is not None else None)
                    finish = d.finish_reason
                    if finish is None and lp is None and tools is None and (
                            not chat or idx in started):
                        # A running choice's event (most of a stream's): its frame, the
                        # text encoded alone (`text_frame`).
                        frame = frames.get(idx)
                        if frame is None:
                            frame = frames[idx] = text_frame(meta, obj, idx, chat)
                        yield f"{frame[0]}{dumps(d.text)}{frame[1]}"
                        continue
                    if not chat:
                        choices = [{"index": idx, "text": d.text, "logprobs": lp,
                                    "finish_reason": finish}]
                    else:
                        if tools is not None:  # a call's header and fragments: several chunks
                            ts = calls.setdefault(idx, ToolDeltas(*tools))
                            deltas, finish = ts.update(d.text, d.finish_reason)
                            if not deltas:  # text held back: a chunk only if it carries something
                                if idx in started and finish is None and lp is None:
                                    continue
                                deltas = [{}]
                        else:
                            deltas = [{"content": d.text}]
                        if idx not in started:
                            started.add(idx)
                            deltas[0]["role"] = "assistant"
                        last = len(deltas) - 1
                        choices = [{"index": idx, "delta": delta,
                                    "logprobs": lp if k == 0 else None,
                                    "finish_reason": finish if k == last else None}
                                   for k, delta in enumerate(deltas)]
                    for choice in choices:
                        yield sse_chunk(meta, obj, choice)
                if out.finished and job.rid not in counted:  # after its last delta is counted
                    counted.add(job.rid)
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    usage["completion_tokens"] += job.tracker.completion_tokens
                    usage["cached_tokens"] += out.num_cached_tokens or 0
            if include_usage:
                final = self._usage(usage["prompt_tokens"], usage["completion_tokens"],
                                    usage["cached_tokens"])
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': final})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (the generator is closed/cancelled)
            for t in tasks:
                t.cancel()
            self._abort(jobs)

    def _logprobs(self, token_ids: list[int], entries, chat: bool, k: int) -> dict | None:
        """OpenAI logprobs: the sampled token's logprob plus the `k` most likely alternatives."""
        if entries is None:
            return None
        tok = self.engine().tokenizer
        dec = lambda t: tok.decode([t])
        tops = [sorted(e.items(), key=lambda kv: -kv[1])[:k] for e in entries]
        if chat:
            item = lambda t, v: {"token": dec(t), "logprob": v, "bytes": list(dec(t).encode())}
            return {"content": [{**item(t, e.get(t, 0.0)), "top_logprobs": [item(a, v) for a, v in top]}
                                for t, e, top in zip(token_ids, entries, tops)]}
        tokens = [dec(t) for t in token_ids]
        offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e.get(t, 0.0) for t, e in zip(token_ids, entries)],
                "top_logprobs": [{dec(a): v for a, v in top} for top in tops], "text_offset": offsets}



def _render_chat(tok, conversation: list[dict], add_generation_prompt: bool,
                 **extra) -> tuple[str, list[int]]:
    """The chat template's text and its token ids (BOS is in the template); a template that
    fails is a 400 naming `messages`. Run off the event loop."""
    try:
        text = tok.apply_chat_template(conversation, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:
        raise InvalidRequestError(f"messages: cannot apply the chat template: {exc}",
                                  "messages") from None
    return text, tok(text, add_special_tokens=False).input_ids


def _assistant_message(text: str, finish: str | None, tools) -> tuple[dict, str | None]:
    """The chat message of a finished output, with the tool calls it makes (if any)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish
    mode, parser, parallel, new_id = tools
    if parser is not None:
        content, calls = parser.parse(text)
        calls = calls if parallel else calls[:1]
    else:
        content, calls = None, calls_from_constrained(text, mode)
        if not calls:
            content = text
    if not calls:
        return {"role": "assistant", "content": content}, finish
    message = {"role": "assistant", "content": content,
               "tool_calls": [c.to_openai(call_id=new_id()) for c in calls]}
    # A named call ends as OpenAI's do ("stop"); calls the model chose end "tool_calls".
    return message, finish if mode not in ("auto", "required") or finish != "stop" \
        else "tool_calls"
