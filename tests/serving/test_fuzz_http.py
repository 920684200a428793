"""Bounded fuzz of the OpenAI HTTP front door: whatever a client sends, no 5xx.

Why: the front door is the only thing between untrusted JSON and the engine thread, and a 5xx
there means a value got past validation into the engine (or a crash in the mapping). schemathesis
generates valid and invalid requests from the app's own OpenAPI schema; every response must be
2xx/4xx, a 4xx must carry OpenAI's error shape (clients parse it), and afterwards the server still
serves and holds no request. A second, smaller fuzz drives a real tiny `LLMEngine`, because only a
real engine has a KV block pool to leak. Deterministic (derandomized, fixed seed) and bounded.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from pagedjax.serving.client import Client
from pagedjax.serving.http import HttpFrontDoor
from tests.serving.fuzz_support import (
    SANE_PARAMS,
    SANE_SAMPLING,
    FuzzFakeEngine,
    assert_pool_whole,
    tiny_engine,
    wait_idle,
)
from tests.serving.inproc import InProcessServer

CONFIG = schemathesis.Config.from_dict({
    "seed": 20240601,
    "generation": {"mode": "all"},
    # The coverage phase's negative half (~430 type mutations, all answered by pydantic) is left
    # out to stay bounded; the fuzzing phase still sends random negative bodies.
    "phases": {"coverage": {"generation": {"mode": "positive"}}},
    "request-timeout": 10,
})
# The schema FastAPI derives from the routes and pydantic models (what a client is promised).
SCHEMA = schemathesis.openapi.from_dict(
    HttpFrontDoor(CollectorRegistry(), "127.0.0.1", 0).app.openapi(), config=CONFIG)

FUZZ_SETTINGS = settings(max_examples=50, derandomize=True, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    fake = FuzzFakeEngine(step_s=0.001)
    srv = InProcessServer(fake, tmp_path_factory.mktemp("fuzz-http"), http_port=0).start()
    client = Client(srv.target, timeout=10)
    client.wait_ready(10)
    session = requests.Session()
    yield fake, srv, client, session, f"http://127.0.0.1:{srv.ports['http_port']}"
    session.close()
    client.close()
    assert srv.close() == 0


def openai_error_shape(ctx, response, case):
    """A 4xx body is OpenAI's error object: {"error": {message, type, param, code}}."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] == response.status_code, err
    return None


def openai_success_shape(ctx, response, case):
    """A 200 from a completion route is a completion object, or SSE chunks ending in [DONE]."""
    if response.status_code != 200 or not case.path.startswith("/v1/"):
        return None
    if case.path == "/v1/models":
        assert response.json()["data"][0]["id"] == "fake"
        return None
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
        assert events and events[-1] == "[DONE]", response.text
        for ev in events[:-1]:
            chunk = json.loads(ev)
            assert "error" not in chunk, chunk  # an error mid-stream is the SSE form of a 5xx
            assert isinstance(chunk["choices"], list)
        return None
    body = response.json()
    assert body["object"] in ("text_completion", "chat.completion"), body
    assert body["choices"] and all(c["finish_reason"] in ("length", "stop") for c in body["choices"]), body
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    return None


CHECKS = [not_a_server_error, response_schema_conformance, openai_error_shape, openai_success_shape]


@SCHEMA.parametrize()
@FUZZ_SETTINGS
def test_fuzz_http_front_door(case, live):
    _, _, _, session, base = live
    response = case.call(base_url=base, session=session, timeout=10)
    case.validate_response(response, checks=CHECKS)


def test_still_serving_and_nothing_in_flight_after_fuzz(live):
    """Runs after the fuzz (file order): the server answers normally and holds no request."""
    fake, _, client, _, base = live
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 w2 ", ok.text
    assert httpx.get(f"{base}/health").status_code == 200
    assert client.generate("hi", {"max_tokens": 2}).outputs[0].finish_reason == "length"
    wait_idle(client)
    assert not fake.has_unfinished_requests()


# ---- a real tiny engine: the KV block pool must be whole after the fuzz ----------------------

# Mostly values the engine accepts, each body with at most one extreme value (see SANE_PARAMS).
_EXTREME_NUMBERS = st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**63, -(2**63), 10**30, 0.0, -0.0, 1e-300,
                                    5e-324, 1e300, -1e300, math.nan, math.inf])  # JSON NaN: Python accepts
_EXTREME = st.tuples(st.sampled_from(sorted({*SANE_PARAMS, "best_of", "length_penalty", "early_stopping",
                                             "use_beam_search", "prompt_logprobs", "echo", "suffix"})),
                     st.one_of(_EXTREME_NUMBERS, st.text(max_size=5), st.lists(_EXTREME_NUMBERS, max_size=2)))
# Short prompts: each new batch shape is an XLA compile (seconds on CPU), and lengths are not
# what this fuzz is about (the engine's length limits have their own tests).
_ids = st.lists(st.integers(0, 95), min_size=1, max_size=12)
_PROMPT = st.one_of(st.text(min_size=1, max_size=12), _ids, st.lists(_ids, min_size=1, max_size=2),
                    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2),
                    st.lists(st.integers(-(2**40), 2**40), max_size=3), st.just(""), st.just([]))


@st.composite
def completion_bodies(draw):
    body = {"prompt": draw(_PROMPT), "stream": draw(st.booleans()), **draw(SANE_SAMPLING)}
    if draw(st.booleans()):
        key, value = draw(_EXTREME)
        body[key] = value
    return body


@pytest.fixture(scope="module", params=["engine thread", "engine process"])
def tiny_live(request, tmp_path_factory):
    """The real tiny engine on the server's thread, and in a child (`--engine-process`:
    text-free streams decoded in the parent, stop strings in the child)."""
    from pagedjax.serving.engine_process import EngineProcess

    child = request.param == "engine process"
    engine = EngineProcess(tiny_engine) if child else tiny_engine()
    srv = InProcessServer(engine, tmp_path_factory.mktemp("fuzz-http-tiny"), http_port=0).start()
    client = Client(srv.target, timeout=30)
    client.wait_ready(30)
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.ports['http_port']}", timeout=30) as http:
        yield engine, client, http
    client.close()
    assert srv.close() == 0
    if child:
        assert engine.close() == 0


# Fuzz finding (fixed in SamplingParams): a stop id >= 2**31 overflowed the sampler's int32 ban
# list inside the engine step, failing every request of that step with a 500.
@example(body={"prompt": [5, 6, 7], "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [2**31]},
         timeout=30.0)
@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=completion_bodies(), timeout=st.sampled_from([30.0, 30.0, 30.0, 0.002]))
def test_fuzz_http_real_engine(tiny_live, body, timeout):
    """No 5xx from a real engine; a short client timeout disconnects mid-request (the server
    must abort it and free its blocks, checked by the next test)."""
    _, _, http = tiny_live
    try:
        r = http.post("/v1/completions", content=json.dumps(body), timeout=timeout,  # NaN allowed
                      headers={"content-type": "application/json"})
    except httpx.TimeoutException:
        assert timeout < 30.0
        return
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    elif body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, (body, r.text)


def test_real_engine_pool_whole_after_fuzz(tiny_live):
    """Runs after the real-engine fuzz: it still generates, and every KV block is free again."""
    engine, client, http = tiny_live
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    s = wait_idle(client)
    if hasattr(engine, "block_manager"):
        assert_pool_whole(engine)
    else:  # in the child: its stats, after its last step
        deadline = time.monotonic() + 10
        while s.num_free_gpu_blocks != s.num_gpu_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
            s = client.stats()
        assert s.num_free_gpu_blocks == s.num_gpu_blocks and not engine.has_unfinished_requests()

