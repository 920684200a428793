"""What one HTTP client may hold open on the OpenAI and metrics ports, and for how long.

A hostile-client probe kept hundreds of idle or half-sent connections open: uvicorn's own
`timeout_keep_alive` only runs after a response, so a connection that never finishes its request
headers, or whose body stops arriving, was held forever. The bounds here, all in `HttpLimits`:

- uvicorn settings where they exist: `limit_concurrency` (beyond it uvicorn answers 503),
  `timeout_keep_alive`;
- `HeaderLimitProtocol`: uvicorn's httptools protocol plus a deadline for the request headers
  and a cap on their size (400);
- `BodyLimitMiddleware`: plain ASGI, a body inactivity timeout (408) and a size cap (413).

The protocol is httptools' (llhttp, in C), as `vllm serve` runs through uvicorn[standard], not
h11's (pure Python), which framed every SSE chunk in Python: with 256 streaming clients the
event loop's thread was busy 0.92x as long for the same chunks (py-spy), the server's CPU a
step 0.91-1.01x per pair on a noisy host (`bench/http_stream.py --compare base`,
docs/v1-core.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds; the defaults never bother a well-behaved client."""

    # Seconds from connecting (or from the first byte of the next keep-alive request) to
    # complete request headers; any real client sends them in one packet (nginx: 60 s,
    # Apache's reqtimeout: 20 s). A total deadline, so trickling header bytes does not extend it.
    header_timeout: float = 10.0
    # Seconds the request body may stall between two reads (nginx's client_body_timeout
    # semantics: a slow but steady upload is fine); a stalled one gets 408.
    body_timeout: float = 30.0
    # Request bodies are JSON prompts: 8 MiB is far above any prompt that fits a context window
    # (token-id lists included) and bounds the memory one request can pin; more gets 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # Open connections per port at which uvicorn answers requests with 503 instead of running
    # them (idle ones still count until a timeout closes them); keep it below `ulimit -n`.
    max_connections: int = 1024
    # uvicorn's default: an idle keep-alive connection is closed 5 s after its last response.
    keep_alive_timeout: float = 5.0
    # The request line plus headers (more: 400 and close), h11's default cap, kept when the
    # protocol became httptools' (llhttp has none). Real clients send well under 2 KiB.
    max_header_bytes: int = 16 * 1024

    def protocol(self) -> type[HeaderLimitProtocol]:
        """The protocol class with these header bounds, for `uvicorn.Config(http=...)`."""
        return type("HeaderLimitProtocol", (HeaderLimitProtocol,),
                    {"header_timeout": self.header_timeout,
                     "max_header_bytes": self.max_header_bytes})

    def config(self, app, **kwargs) -> uvicorn.Config:
        """A `uvicorn.Config` serving `app` (wrapped in `BodyLimitMiddleware`) under these limits."""
        return uvicorn.Config(BodyLimitMiddleware(app, self), http=self.protocol(), ws="none",
                              limit_concurrency=self.max_connections,
                              timeout_keep_alive=self.keep_alive_timeout,  # type: ignore[arg-type]
                              log_level="warning", lifespan="off", **kwargs)


class HeaderLimitProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for request headers and a cap on their size,
    which uvicorn lacks (its keep-alive timer starts only after a response, and any received
    byte cancels it; llhttp takes headers of any length).

    Deadline: whenever no request is being handled on the connection (just connected, or the
    last response is complete) and bytes arrive or the connection opens, a timer is armed once;
    it closes the transport unless a complete request reached the app by then. Armed once per
    request, not per byte, so trickled headers (slowloris) or a trickled unread body after an
    early response do not extend it.

    Size: a head over ``max_header_bytes`` gets a 400 and the connection closes, as h11
    answered its own cap. A head that completes is measured by the parser's callbacks (its URL
    and headers); one still incomplete by the bytes received since it began (from the
    connection's start or the end of the last request's body, so requests pipelined behind a
    streaming response are capped too)."""

    header_timeout: float = 10.0
    max_header_bytes: int = 16 * 1024
    _header_timer: asyncio.TimerHandle | None = None
    _head_open = True  # a request's head is being received (or none has begun)
    _head_bytes = 0  # bytes received while it is
    _head_len = 0  # its URL and headers so far, as the parser reports them

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():  # answered 400 by the parser
            self._cancel_header_timer()
            return
        if self._head_open and self._head_bytes > self.max_header_bytes:
            self._cancel_header_timer()
            self.send_400_response(
                f"Request line and headers exceed {self.max_header_bytes} bytes.")
            return
        if self._between_requests():
            self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def on_message_begin(self) -> None:
        self._head_len = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_len += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_len += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_len > self.max_header_bytes:  # uvicorn answers a parser error with 400
            raise httptools.HttpParserError(
                f"request line and headers exceed {self.max_header_bytes} bytes")
        self._head_open, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes = True, 0  # what follows is the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


class BodyLimitMiddleware:
    """Body timeout (408) and size cap (413) as plain ASGI around `receive`, answering in the
    OpenAI error shape with `Connection: close` (the rest of the body is never read).

    Not Starlette's BaseHTTPMiddleware (it hides client disconnects from endpoints that poll for
    them), and not FastAPI's `max_body_size` (only in releases newer than this project requires).
    The timeout applies only while the body is incomplete and no response has started: once the
    body is in, `receive` is the endpoints' disconnect poll and passes straight through."""

    def __init__(self, app, limits: HttpLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > cap:  # refuse up front, before reading a byte
            await _reply(send, 413, f"request body: {declared} bytes exceeds the limit of {cap} bytes",
                         "invalid_request_error")
            return
        received = 0
        body_done = started = answered = False

        async def answer(status: int, message: str, type_: str) -> dict:
            nonlocal started, answered
            if not started:
                started = answered = True
                await _reply(send, status, message, type_)
            return {"type": "http.disconnect"}  # the app stops reading; its own reply is dropped

        async def limited_receive():
            nonlocal received, body_done
            if body_done or started:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout)
            except TimeoutError:
                return await answer(408, f"request body: nothing received for {self.limits.body_timeout:g} s",
                                    "timeout_error")
            if message["type"] != "http.request":  # the client went away
                body_done = True
                return message
            received += len(message.get("body", b""))
            if received > cap:
                return await answer(413, f"request body: exceeds the limit of {cap} bytes",
                                    "invalid_request_error")
            body_done = not message.get("more_body", False)
            return message

        async def guarded_send(message):
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


async def _reply(send, status: int, message: str, type_: str) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: `run_server` owns SIGTERM for every port."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class BoundServer:
    """A uvicorn server under `HttpLimits` on the running event loop (no thread per connection).
    `start` binds before serving, so port 0 gives its ephemeral port at once."""

    def __init__(self, app, host: str, port: int, limits: HttpLimits, grace_s: float = 5.0):
        self.host, self.port = host, port
        self.config = limits.config(app, timeout_graceful_shutdown=grace_s)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind now, serve in a task; returns the bound port."""
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto
        # says TCP, and without it every response waited ~40 ms on the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._server = _QuietServer(self.config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        return sock.getsockname()[1]

    async def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout)
