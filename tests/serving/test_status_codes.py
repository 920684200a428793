"""Status-code mapping of the gRPC server, over a fake engine (fast and deterministic)."""

from __future__ import annotations

import grpc
import pytest

from pagedjax.serving.client import Client
from tests.serving.fake_engine import FakeEngine
from tests.serving.inproc import InProcessServer


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    fake = FakeEngine(step_s=0.005)
    srv = InProcessServer(fake, tmp_path_factory.mktemp("fake"), max_waiting_requests=2, http_port=0).start()
    client = Client(srv.target, timeout=10)
    client.wait_ready(10)
    yield fake, srv, client
    client.close()
    assert srv.close() == 0


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_internal_error_is_per_request(fake_server):
    _, _, client = fake_server
    code, details = _code(lambda: client.generate("boom", {"max_tokens": 3}))
    assert code == grpc.StatusCode.INTERNAL and "boom" in details
    assert client.generate("fine", {"max_tokens": 3}).outputs[0].text == "w0 w1 w2 "


def test_queue_full_is_resource_exhausted(fake_server):
    fake, _, client = fake_server
    fake.gate.clear()
    try:
        calls = [client.generate_stream("hi", {"max_tokens": 2}, request_id=f"w{i}") for i in range(2)]
        # make sure both were accepted before the third arrives
        for _ in range(200):
            if client.stats().num_in_flight == 2:
                break
        code, details = _code(lambda: client.generate("hi", {"max_tokens": 2}))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests" in details
    finally:
        fake.gate.set()
    assert [list(c)[-1].outputs[0].finish_reason for c in calls] == ["length", "length"]


def test_not_found_and_unimplemented(fake_server):
    _, _, client = fake_server
    assert _code(lambda: client.abort("never-sent"))[0] == grpc.StatusCode.NOT_FOUND
    code, details = _code(lambda: client.generate("hi", {"temperature": 0.0, "early_stopping": "maybe"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "early_stopping" in details
    info = client.model_info()
    assert (info.model, info.block_size, info.num_gpu_blocks) == ("fake", 16, 32)


def test_http_status_codes(fake_server):
    import httpx

    fake, srv, client = fake_server
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions"
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 w2 "
    boom = httpx.post(url, json={"prompt": "boom", "max_tokens": 3})
    assert boom.status_code == 500 and "boom" in boom.json()["error"]["message"]
    fake.gate.clear()
    try:
        waiting = [client.generate_stream("hi", {"max_tokens": 2}) for _ in range(2)]
        for _ in range(200):
            if client.stats().num_in_flight == 2:
                break
        full = httpx.post(url, json={"prompt": "hi", "max_tokens": 2})
        assert full.status_code == 429 and full.json()["error"]["type"] == "resource_exhausted"
    finally:
        fake.gate.set()
    assert all(list(w)[-1].finished for w in waiting)
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    # Bodies that are not UTF-8, and unknown routes/methods, get the OpenAI error shape too.
    for body in (b'{"prompt": "\xff\xfe"}', b"\xff\xfe\x00"):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(url)  # GET on a POST route
    assert r.status_code == 405 and "error" in r.json() and "detail" not in r.json(), r.text
    r = httpx.get(url.replace("/v1/completions", "/v1/nowhere"))
    assert r.status_code == 404 and "error" in r.json() and "detail" not in r.json(), r.text


_MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,body,field", [
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "suffix": "and then"}, "suffix"),
    ("chat/completions", {"messages": _MSGS, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": _MSGS, "function_call": "auto"}, "function_call"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "image_url"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "input_audio"),
], ids=lambda v: v if isinstance(v, str) and "/" not in v and v != "completions" else None)
def test_fields_documented_as_refused_are_400_naming_them(fake_server, route, body, field):
    """docs/serving-parity.md lists what is refused rather than ignored: each is a 400 whose
    message (and `param`, where the field is a top-level one) names it."""
    import httpx

    _, srv, _ = fake_server
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/{route}"
    r = httpx.post(url, json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"], err
    if field in ("echo", "suffix"):
        assert err["param"] == field and err["message"].startswith(field)
    # Their harmless values are accepted.
    if route == "completions":
        ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "echo": False,
                                   "suffix": None}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 "


def test_undecodable_protobuf_is_invalid_argument(fake_server):
    """Bytes that do not parse as the method's message are the client's error
    (INVALID_ARGUMENT naming the message), not UNKNOWN; the server keeps serving."""
    _, srv, client = fake_server
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with grpc.insecure_channel(srv.target) as ch:
        for method, stream in (("Generate", True), ("Abort", False), ("GetModelInfo", False),
                               ("GetStats", False)):
            make = ch.unary_stream if stream else ch.unary_unary
            call = make(f"/pagedjax.v1.PagedJax/{method}", **raw)
            code, details = _code(lambda call=call, stream=stream: (
                list(call(b"\xff\xff\xff\xff", timeout=10)) if stream
                else call(b"\xff\xff\xff\xff", timeout=10)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
            assert details.startswith("request: not a valid"), details
    assert [o for o in client.generate_stream("hi", {"max_tokens": 2})][-1].finished


def test_priority_reaches_the_engine_from_both_front_doors(fake_server):
    """`GenerateRequest.priority` and the HTTP body's `priority` (completions; chat requests
    share the field and the path) arrive as the engine's `add_request(priority=)` (the fake
    engine takes any; the real one checks its policy)."""
    import httpx

    fake, srv, client = fake_server
    before = set(fake.priorities)
    assert client.generate("hi", {"max_tokens": 2}, priority=-7).outputs
    r = httpx.post(f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions", timeout=10,
                   json={"model": "fake", "prompt": "hi", "max_tokens": 2, "priority": 5})
    assert r.status_code == 200, r.text
    assert sorted(v for k, v in fake.priorities.items() if k not in before) == [-7, 5]
