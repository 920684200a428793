"""Hostile HTTP clients (idle, half-sent, stalled, oversized) against the real uvicorn server over
raw sockets: the bounds of `HttpLimits` on the OpenAI and metrics ports, with short timeouts."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from pagedjax.serving.client import Client
from pagedjax.serving.http_limits import HttpLimits
from tests.serving.fake_engine import FakeEngine
from tests.serving.inproc import InProcessServer

HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_BODY = 0.5, 1.0, 0.5, 4096
SLACK_S = 2.5  # a busy 2-core CI machine; the limits are what is tested, not the scheduler
LIMITS = HttpLimits(header_timeout=HEADER_S, body_timeout=BODY_S, keep_alive_timeout=KEEP_ALIVE_S,
                    max_body_bytes=MAX_BODY)
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def _serve(tmp, limits: HttpLimits):
    fake = FakeEngine(step_s=0.005)
    srv = InProcessServer(fake, tmp, http_port=0, http_limits=limits).start()
    with Client(srv.target, timeout=10) as client:
        client.wait_ready(10)
    return fake, srv


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    fake, srv = _serve(tmp_path_factory.mktemp("limits"), LIMITS)
    yield fake, srv
    assert srv.close() == 0


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _open_after(socks: list[socket.socket], within: float) -> int:
    """How many of `socks` the server has not closed (EOF or reset) `within` seconds from now."""
    deadline = time.monotonic() + within
    still_open = 0
    for s in socks:
        try:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            while s.recv(65536):  # anything before the EOF (none expected) is skipped
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            still_open += 1
        finally:
            s.close()
    return still_open


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (by Content-Length, else to EOF)."""
    s.settimeout(BODY_S + SLACK_S + 2)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    size = int(headers["content-length"]) if "content-length" in headers else None
    while size is None or len(body) < size:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def _assert_openai_error(status: int, headers: dict, body: bytes, code: int) -> dict:
    assert status == code, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert headers.get("connection") == "close"
    return err


def test_idle_and_half_sent_connections_are_closed(limited):
    _, srv = limited
    t0 = time.monotonic()
    socks = [_connect(srv.ports["http_port"]) for _ in range(50)]
    for i, s in enumerate(socks):
        if i % 2:  # half of them send part of the request line and headers, then stall
            s.sendall(HEAD[: 10 + i])
    assert _open_after(socks, HEADER_S + SLACK_S) == 0
    assert HEADER_S - 0.1 < time.monotonic() - t0 < HEADER_S + SLACK_S


def test_trickled_headers_do_not_extend_the_deadline(limited):
    """Slowloris: a byte of headers every 0.1 s; the header deadline is a total, not an idle time."""
    _, srv = limited
    s = _connect(srv.ports["http_port"])
    s.settimeout(0.1)
    t0 = time.monotonic()
    closed = False
    for byte in HEAD + b"X-Slow: " + b"a" * 200:
        try:
            s.sendall(bytes([byte]))
            if s.recv(1) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            closed = True
            break
    s.close()
    assert closed and time.monotonic() - t0 < HEADER_S + SLACK_S


def test_keep_alive_connection_half_sending_its_next_request_is_closed(limited):
    """After a response uvicorn's keep-alive timer stops at the first byte of the next request;
    the header deadline takes over from there."""
    _, srv = limited
    s = _connect(srv.ports["http_port"])
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, _ = _read_response(s)
    assert status == 200 and headers.get("connection") != "close"
    s.sendall(HEAD[:20])
    assert _open_after([s], HEADER_S + SLACK_S) == 0


def test_oversized_request_head_is_400_and_closed(limited):
    """llhttp takes heads of any length: `HeaderLimitProtocol` caps the request line plus
    headers at `max_header_bytes`, whether the head arrives whole or never completes, on a new
    connection or a keep-alive one after a response. A head under the cap is served."""
    _, srv = limited
    port, cap = srv.ports["http_port"], LIMITS.max_header_bytes
    line = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n"

    def refused(s: socket.socket, data: bytes) -> None:
        s.sendall(data)
        t0 = time.monotonic()
        status, headers, _ = _read_response(s)
        assert status == 400 and headers.get("connection") == "close"
        assert time.monotonic() - t0 < HEADER_S  # the cap's answer, not the deadline's close
        assert _open_after([s], SLACK_S) == 0

    s = _connect(port)
    s.sendall(line + b"X-Pad: " + b"a" * (cap - 200) + b"\r\n\r\n")
    status, headers, _ = _read_response(s)
    assert status == 200 and headers.get("connection") != "close"
    refused(s, line + b"X-Pad: " + b"a" * (cap + 100))  # kept alive, its end never sent
    refused(_connect(port), line + b"X-Pad: " + b"a" * (cap + 100) + b"\r\n\r\n")  # whole
    refused(_connect(port), line + b"X-Pad: " + b"a" * (cap + 100))  # new, never ends


def test_stalled_body_is_408(limited):
    _, srv = limited
    s = _connect(srv.ports["http_port"])
    t0 = time.monotonic()
    s.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt":')  # 10 of 100 bytes
    status, headers, body = _read_response(s)
    err = _assert_openai_error(status, headers, body, 408)
    assert "request body" in err["message"]
    assert BODY_S - 0.1 < time.monotonic() - t0 < BODY_S + SLACK_S
    assert _open_after([s], SLACK_S) == 0  # and the connection is closed


def test_oversized_body_is_413_by_content_length(limited):
    _, srv = limited
    s = _connect(srv.ports["http_port"])
    s.sendall(HEAD + f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode())  # refused before the body
    err = _assert_openai_error(*_read_response(s), 413)
    assert str(MAX_BODY) in err["message"]
    assert _open_after([s], SLACK_S) == 0
    # exactly at the limit is fine
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    ok = httpx.post(f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions",
                    content=body + b" " * (MAX_BODY - len(body)),
                    headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_oversized_body_is_413_when_chunked(limited):
    _, srv = limited
    s = _connect(srv.ports["http_port"])
    chunk = b"x" * 1000
    chunks = b"".join(b"3e8\r\n" + chunk + b"\r\n" for _ in range(5))  # 5 x 1000 bytes, no end
    s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
    _assert_openai_error(*_read_response(s), 413)
    assert _open_after([s], SLACK_S) == 0


def test_normal_and_slow_but_steady_clients_still_work(limited):
    _, srv = limited
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions"
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 w2 "
    # A body in five pieces 0.35 s apart: 1.4 s in all, longer than the body timeout, never idle that long.
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    s = _connect(srv.ports["http_port"])
    s.sendall(HEAD + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
    pieces = [body[i: i + 7] for i in range(0, len(body), 7)][:4]
    pieces.append(body[sum(map(len, pieces)):])
    t0 = time.monotonic()
    for piece in pieces:
        time.sleep(0.35)
        s.sendall(piece)
    status, _, resp = _read_response(s)
    s.close()
    assert time.monotonic() - t0 > BODY_S
    assert status == 200 and json.loads(resp)["choices"][0]["text"] == "w0 w1 "


def test_slow_generation_is_not_a_body_timeout(limited):
    """Endpoints poll `receive` for disconnects while the engine works: once the body is in, no
    timeout applies, for plain and streaming responses alike."""
    fake, srv = limited
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions"
    results: dict[str, httpx.Response] = {}

    def call(name: str, stream: bool) -> None:
        results[name] = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "stream": stream}, timeout=30)

    fake.gate.clear()
    try:
        threads = [threading.Thread(target=call, args=(n, n == "stream")) for n in ("plain", "stream")]
        for t in threads:
            t.start()
        time.sleep(BODY_S * 2)
    finally:
        fake.gate.set()
    for t in threads:
        t.join(30)
    assert results["plain"].status_code == 200 and results["plain"].json()["choices"][0]["text"] == "w0 w1 "
    assert results["stream"].status_code == 200 and results["stream"].text.endswith("data: [DONE]\n\n")


def test_metrics_port_is_async_and_times_out_idle_connections(limited):
    _, srv = limited
    port = srv.ports["metrics_port"]
    r = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "pagedjax_requests_total" in r.text
    before = threading.active_count()
    socks = [_connect(port) for _ in range(20)]
    time.sleep(min(0.2, HEADER_S / 2))
    assert threading.active_count() - before < 5  # was one thread per connection
    assert _open_after(socks, HEADER_S + SLACK_S) == 0


def test_connection_cap_answers_503_until_idle_connections_time_out(tmp_path):
    """Idle connections count against `max_connections`; the header timeout frees them."""
    fake, srv = _serve(tmp_path, HttpLimits(header_timeout=1.5, max_connections=20))
    try:
        url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/models"
        idle = [_connect(srv.ports["http_port"]) for _ in range(20)]
        time.sleep(0.1)
        assert httpx.get(url).status_code == 503
        assert _open_after(idle, 1.5 + SLACK_S) == 0
        assert httpx.get(url).status_code == 200
    finally:
        assert srv.close() == 0


def test_cli_flags_set_the_limits():
    from pagedjax.cli import build_parser, serve_options

    args = build_parser().parse_args(["serve", "--http-header-timeout", "3", "--http-body-timeout", "7",
                                      "--http-max-body-bytes", "1000"])
    want = HttpLimits(header_timeout=3, body_timeout=7, max_body_bytes=1000)
    assert serve_options(args).http_limits == want
    assert serve_options(build_parser().parse_args(["serve"])).http_limits == HttpLimits()
