"""Request ids are per-connection labels (issue 16): one client can neither abort nor detect
(through a duplicate-id error) another client's requests, across gRPC and HTTP."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest

from pagedjax.serving.client import Client
from tests.serving.fake_engine import FakeEngine
from tests.serving.inproc import InProcessServer


@pytest.fixture(scope="module", params=["engine thread", "engine process"])
def srv(request, tmp_path_factory):
    """The same server with the engine on its thread and in a child (`--engine-process`)."""
    from pagedjax.serving.engine_process import EngineProcess

    child = request.param == "engine process"
    engine = EngineProcess(FakeEngine, 0.01) if child else FakeEngine(step_s=0.01)
    s = InProcessServer(engine, tmp_path_factory.mktemp("iso"), http_port=0).start()
    yield s
    assert s.close() == 0
    if child:
        assert engine.close() == 0


def test_same_label_on_two_connections_is_two_requests(srv):
    with Client(srv.target, timeout=30) as a, Client(srv.target, timeout=30) as b:
        a.wait_ready(10)
        call_a = a.generate_stream("hi", {"max_tokens": 60}, request_id="job")
        assert next(call_a).request_id == "job"
        # b may use the same id (no ALREADY_EXISTS leak) and cannot abort a's request
        assert b.generate("hi", {"max_tokens": 2}, request_id="job").outputs[0].text == "w0 w1 "
        with pytest.raises(grpc.RpcError) as e:
            b.abort("job")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # a's own duplicate is refused, and a can abort its own request
        with pytest.raises(grpc.RpcError) as e:
            a.generate("hi", {"max_tokens": 2}, request_id="job")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert a.abort("job") == ["job"]
        assert list(call_a)[-1].outputs[0].finish_reason == "abort"


def test_grpc_abort_cannot_reach_an_http_request(srv):
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions"
    result = {}

    def post():
        result["r"] = httpx.post(url, timeout=60, json={"model": "fake", "prompt": "hi",
                                                        "max_tokens": 40, "request_id": "shared"})

    t = threading.Thread(target=post)
    t.start()
    with Client(srv.target, timeout=30) as c:
        for _ in range(200):
            if c.stats().num_in_flight:
                break
        with pytest.raises(grpc.RpcError) as e:
            c.abort("shared")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    t.join()
    body = result["r"].json()
    assert body["id"] == "shared" and body["choices"][0]["finish_reason"] == "length"


def test_labels_are_bounded_and_single_line(srv):
    with Client(srv.target, timeout=30) as c:
        for bad in ("x" * 257, "a\nforged log line"):
            with pytest.raises(grpc.RpcError) as e:
                c.generate("hi", {"max_tokens": 2}, request_id=bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("request_id")
    url = f"http://127.0.0.1:{srv.ports['http_port']}/v1/completions"
    r = httpx.post(url, timeout=30, json={"model": "fake", "prompt": "hi", "max_tokens": 2,
                                          "request_id": "a\nb"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
