"""`--api-key` on both front doors (issue 16), over the fake engine: no key, a wrong key or a
wrong scheme is refused before any work; health, metrics and gRPC health stay open."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pagedjax.serving.auth import bearer_ok, resolve_api_key
from pagedjax.serving.client import Client
from tests.serving.fuzz_support import FuzzFakeEngine
from tests.serving.inproc import InProcessServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    srv = InProcessServer(FuzzFakeEngine(step_s=0.002), tmp_path_factory.mktemp("keyed"),
                          http_port=0, api_key=KEY).start()
    yield srv
    assert srv.close() == 0


def test_grpc_needs_the_key(keyed_server):
    with Client(keyed_server.target, timeout=10, api_key="") as anon:
        anon.wait_ready(10)  # gRPC health is open
        for call in (lambda: anon.generate("hi", {"max_tokens": 2}), anon.model_info, anon.stats,
                     lambda: anon.abort("x")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(keyed_server.target, timeout=10, api_key="wrong") as bad:
        with pytest.raises(grpc.RpcError) as e:
            bad.generate("hi", {"max_tokens": 2})
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(keyed_server.target, timeout=10, api_key=KEY) as good:
        assert good.generate("hi", {"max_tokens": 3}).outputs[0].text == "w0 w1 w2 "
        assert good.model_info().model == "fake"


def test_http_needs_the_key_on_v1_only(keyed_server):
    base = f"http://127.0.0.1:{keyed_server.ports['http_port']}"
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                    {"authorization": KEY}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=30).status_code == 401
    ok = httpx.post(f"{base}/v1/completions", json=body, timeout=30,
                    headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 "
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200


def test_tokenize_and_detokenize_need_the_key(keyed_server):
    """As vLLM's: /tokenize and /detokenize are API routes behind --api-key (they reveal the
    chat template and the tokenizer), while /health, /metrics and /version stay open."""
    base = f"http://127.0.0.1:{keyed_server.ports['http_port']}"
    calls = [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": [
        {"role": "user", "content": "hi"}]}), ("/detokenize", {"tokens": [72, 73]})]
    for route, body in calls:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = httpx.post(base + route, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (route, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(base + route, json=body, timeout=30,
                        headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, (route, ok.text)
        assert ("tokens" if route == "/tokenize" else "prompt") in ok.json()
    assert httpx.get(f"{base}/version", timeout=30).status_code == 200


def test_key_resolution_and_compare(monkeypatch):
    monkeypatch.delenv("PAGEDJAX_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("PAGEDJAX_API_KEY", "env-key")
    assert resolve_api_key(None) == "env-key" and resolve_api_key("flag") == "flag"
    with pytest.raises(ValueError, match="api_key"):
        resolve_api_key("  ")
    assert bearer_ok("Bearer k", "k") and bearer_ok("bearer  k", "k")
    assert not bearer_ok("Bearer k2", "k") and not bearer_ok(None, "k") and not bearer_ok("k", "k")
