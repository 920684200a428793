"""Front-door side of issue 16's engine items, over a fake engine: NOT_SERVING while the engine
rebuilds a lost KV cache (gRPC health, HTTP /health, metrics), multi-prompt requests admitted
together and capped in sequences, and error metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from pagedjax.serving.client import Client
from tests.serving.fuzz_support import FuzzFakeEngine
from tests.serving.inproc import InProcessServer


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    fake = FuzzFakeEngine(step_s=0.005)
    s = InProcessServer(fake, tmp_path_factory.mktemp("health"), http_port=0,
                        max_sequences_per_request=16).start()
    client = Client(s.target, timeout=10)
    client.wait_ready(10)
    http = httpx.Client(base_url=f"http://127.0.0.1:{s.ports['http_port']}", timeout=10)
    yield fake, s, client, http
    http.close()
    client.close()
    assert s.close() == 0


def _metric(srv_, name: str) -> float:
    """A metric's value, summed over its label sets."""
    text = httpx.get(f"http://127.0.0.1:{srv_.ports['metrics_port']}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    assert values, f"{name} not exported"
    return sum(values)


def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_unhealthy_engine_reports_not_serving_on_both_doors_and_recovers(srv):
    fake, s, client, http = srv
    assert client.health() == "SERVING" and http.get("/health").status_code == 200
    fake.healthy = False
    try:
        _until(lambda: client.health() == "NOT_SERVING")
        assert http.get("/health").status_code == 503
        assert _metric(s, "pagedjax_engine_healthy") == 0
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "rebuilding" in r.json()["error"]["message"]
    finally:
        fake.healthy = True
    _until(lambda: client.health() == "SERVING")
    assert http.get("/health").status_code == 200 and _metric(s, "pagedjax_engine_healthy") == 1
    assert client.generate("hi", {"max_tokens": 2}).outputs[0].finish_reason == "length"


def test_list_of_prompts_is_admitted_in_one_step_and_capped(srv):
    fake, s, client, http = srv
    before = _metric(s, 'pagedjax_requests_refused_total')
    r = http.post("/v1/completions", json={"prompt": [f"p{i}" for i in range(12)], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 12
    steps = [v for k, v in fake.added_at.items() if k.startswith("http-")][-12:]
    assert len(set(steps)) == 1, steps  # all twelve entered between the same two steps
    r = http.post("/v1/completions", json={"prompt": [f"p{i}" for i in range(6)], "n": 3,
                                            "temperature": 1.0, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert "18 sequences exceed max_sequences_per_request=16" in err["message"]
    assert _metric(s, 'pagedjax_requests_refused_total') == before + 1
    assert not fake.has_unfinished_requests()


def test_chat_default_max_tokens_is_what_fits(srv):
    """Without max_tokens, chat asks for what the context and the cache allow (the engine's
    `max_output_tokens`), never for more (which strict admission would refuse)."""
    fake, _, _, http = srv
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    rid = [k for k in fake.asked if k.startswith("http-")][-1]  # the latest admitted
    prompt_len, asked = fake.asked[rid]  # the fake caps generation itself; the ask is recorded
    assert prompt_len > 3 and asked == fake.max_output_tokens(prompt_len, 1) > 0


def test_departed_client_aborts_every_prompt_of_its_request(srv):
    """A non-streaming client with a list of prompts that gives up: all its sub-requests are
    aborted at once (before: admitted one per step, and worked on long after it left)."""
    fake, s, client, http = srv
    fake.gate.clear()  # nothing progresses: the client can only time out
    try:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": [f"q{i}" for i in range(10)],
                                               "max_tokens": 3}, timeout=httpx.Timeout(5, read=0.5))
        _until(lambda: not fake._reqs and client.stats().num_in_flight == 0)
    finally:
        fake.gate.set()
    assert client.generate("hi", {"max_tokens": 2}).outputs[0].finish_reason == "length"


def test_refusal_counts_are_exported_at_zero_before_any_refusal():
    """Each refusal kind is a series from the start (a scraper's rate needs its base; a test on a
    fresh server must not depend on an earlier one having refused something)."""
    from prometheus_client import generate_latest

    from pagedjax.serving.errors import REFUSAL_KINDS, QueueFullError
    from pagedjax.serving.metrics import ServingMetrics

    m = ServingMetrics()
    text = generate_latest(m.registry).decode()
    assert {"invalid_argument", "resource_exhausted", "unavailable"} <= set(REFUSAL_KINDS)
    for kind in REFUSAL_KINDS:
        assert f'pagedjax_requests_refused_total{{kind="{kind}"}} 0.0' in text
    m.refused.labels(QueueFullError.kind).inc()
    assert 'pagedjax_requests_refused_total{kind="resource_exhausted"} 1.0' in generate_latest(
        m.registry).decode()
