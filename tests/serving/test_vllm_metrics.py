"""A server with the HTTP port alone (as `pagedjax serve MODEL` starts: no gRPC, no separate
metrics port), over a real tiny engine whose KV pool holds less than two full sequences and
which runs two at a time: completions and /metrics on the one port, vLLM's per-request phase
histograms (prefill, decode, inference, queue) in a sane order, requests waiting behind
max_num_seqs, and preemptions, all scraped under vLLM's names."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedjax.cli import build_parser, serve_options
from tests.serving.fuzz_support import tiny_engine
from tests.serving.inproc import InProcessServer

MODEL = "[tiny]"  # the model_name label of the tiny engine's vllm: metrics
PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
          "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def http_only(tmp_path_factory):
    # The ports `pagedjax serve MODEL` opens by default: HTTP only.
    cli = serve_options(build_parser().parse_args(["serve", "tiny", "--port", "0",
                                                   "--max-model-len", "64"]))
    assert (cli.port, cli.metrics_port, cli.http_port) == (None, None, 0)
    # 10 blocks of 8: one sequence of 64 tokens fits, two long ones do not (preemption).
    engine = tiny_engine(max_num_seqs=2, num_gpu_blocks=10)
    srv = InProcessServer(engine, tmp_path_factory.mktemp("http-only"), host=cli.host,
                          port=cli.port, metrics_port=cli.metrics_port,
                          http_port=cli.http_port).start()
    assert set(srv.ports) == {"http_port"} and srv.target is None
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.ports['http_port']}", timeout=120) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "not serving"
            time.sleep(0.05)
        yield engine, http
    assert srv.close() == 0


def scrape(http: httpx.Client) -> dict[str, float]:
    """Samples of /metrics on the HTTP port, keyed name[label values] (buckets left out)."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if "le" not in s.labels:
                out[s.name + "".join(f"[{v}]" for v in s.labels.values())] = s.value
    return out


def complete(http: httpx.Client, prompt: str, max_tokens: int) -> dict:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_and_request_phase_histograms(http_only):
    _, http = http_only
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    for i, max_tokens in enumerate((3, 9, 17)):
        before = scrape(http)
        out = complete(http, f"prompt number {i}", max_tokens)
        assert out["usage"]["completion_tokens"] == max_tokens
        after = scrape(http)
        d = {h: after[f"{h}_sum{MODEL}"] - before.get(f"{h}_sum{MODEL}", 0) for h in PHASES}
        for h in PHASES + ("vllm:request_params_max_tokens", "vllm:request_prompt_tokens",
                           "vllm:request_generation_tokens"):
            assert after[f"{h}_count{MODEL}"] - before.get(f"{h}_count{MODEL}", 0) == 1, h
        assert after[f"vllm:request_params_max_tokens_sum{MODEL}"] - before.get(
            f"vllm:request_params_max_tokens_sum{MODEL}", 0) == max_tokens
        assert after[f"vllm:request_generation_tokens_sum{MODEL}"] - before.get(
            f"vllm:request_generation_tokens_sum{MODEL}", 0) == max_tokens
        prefill, decode = d["vllm:request_prefill_time_seconds"], \
            d["vllm:request_decode_time_seconds"]
        inference = d["vllm:request_inference_time_seconds"]
        # One request's phases, in order: queue, prefill, decode (inference = the last two).
        assert 0 <= prefill <= inference and 0 < decode <= inference
        assert inference == pytest.approx(prefill + decode, abs=1e-9)
        assert d["vllm:time_to_first_token_seconds"] == pytest.approx(
            d["vllm:request_queue_time_seconds"] + prefill, abs=1e-6)
        assert inference <= d["vllm:e2e_request_latency_seconds"]
    assert after[f"vllm:request_success_total[length]{MODEL}"] >= 3


def test_waiting_requests_and_preemptions(http_only):
    """Four long requests where two run at a time: the others wait (vllm:num_requests_waiting
    is non-zero meanwhile), and the two running outgrow the 10-block pool (preemption)."""
    engine, http = http_only
    before = scrape(http)
    results: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        complete(http, f"req {i}", 48))) for i in range(4)]
    for t in threads:
        t.start()
    waiting, running = set(), set()
    while any(t.is_alive() for t in threads):
        m = scrape(http)
        waiting.add(m[f"vllm:num_requests_waiting{MODEL}"])
        running.add(m[f"vllm:num_requests_running{MODEL}"])
        assert m["pagedjax_num_requests_waiting"] + m["pagedjax_num_requests_swapped"] == \
            m[f"vllm:num_requests_waiting{MODEL}"]
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r["usage"]["completion_tokens"] == 48 for r in results)
    assert max(waiting) >= 1, waiting  # queued behind max_num_seqs=2
    assert max(running) <= 2
    after = scrape(http)
    preempted = after[f"vllm:num_preemptions_total{MODEL}"] - \
        before.get(f"vllm:num_preemptions_total{MODEL}", 0)
    assert preempted > 0
    assert after[f"vllm:num_preemptions_total{MODEL}"] == \
        after["pagedjax_num_preemptions_total"] == engine.get_stats().num_preemptions_total
    assert after[f"vllm:num_requests_waiting{MODEL}"] == 0
    assert after[f"vllm:num_requests_running{MODEL}"] == 0
    assert after[f"vllm:request_prefill_time_seconds_count{MODEL}"] - \
        before[f"vllm:request_prefill_time_seconds_count{MODEL}"] == 4
