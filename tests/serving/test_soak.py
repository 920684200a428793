"""A bounded soak of both front doors over a real (tiny) engine (issue 16).

For `PAGEDJAX_SOAK_S` seconds (default 40) several client threads mix normal traffic over gRPC
and HTTP with aborts, cancelled streams, disconnecting HTTP clients, and oversized or malformed
requests. Afterwards: every normal request's output equals the same prompt generated alone by
the independent reference, no hostile request got a 5xx / INTERNAL / UNKNOWN, nothing is left
in flight, the KV block pool is whole, no threads leaked, and the resident memory grew by less
than a bound between the end of the first quarter of the run and its end.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import grpc
import httpx
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM
from pagedjax.reference import ReferenceGenerator
from pagedjax.serving.client import Client
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.serving.fuzz_support import ToyTokenizer, assert_pool_whole, wait_idle
from tests.serving.inproc import InProcessServer

SOAK_S = float(os.environ.get("PAGEDJAX_SOAK_S", "40"))
MAX_TOKENS = 6
RSS_GROWTH_BOUND_MB = 150
BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def soak_setup(tmp_path_factory):
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    params = assemble_params(config, random_hf_tensors(config, seed=21).get)
    tok = ToyTokenizer(config.vocab_size)
    llm = LLM.from_params(config, params, tok, model_name="tiny", num_gpu_blocks=48,
                          block_size=8, max_num_seqs=8, max_model_len=64, layer_loop="scan")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(rng.randrange(2, 20))]
               for _ in range(12)]
    ref = ReferenceGenerator(config, params).generate(prompts, MAX_TOKENS)
    srv = InProcessServer(llm.engine, tmp_path_factory.mktemp("soak"), http_port=0).start()
    yield llm.engine, srv, prompts, ref, tok
    assert srv.close() == 0


def test_soak(soak_setup):
    engine, srv, prompts, ref, tok = soak_setup
    http_base = f"http://127.0.0.1:{srv.ports['http_port']}"
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with Client(srv.target, timeout=60) as c:
        c.wait_ready(60)
        c.generate(prompts[0], greedy)  # compile the common shapes before measuring anything
    threads_before = threading.active_count()
    stop_at = time.monotonic() + SOAK_S
    rss: dict[str, float] = {}
    results: list[tuple[int, list[int] | str]] = []  # (prompt index, tokens or text)
    problems: list[str] = []
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def note(kind: str) -> None:
        with lock:
            counts[kind] = counts.get(kind, 0) + 1

    def normal_grpc(seed: int) -> None:
        rng = random.Random(seed)
        with Client(srv.target, timeout=60) as c:
            while time.monotonic() < stop_at:
                i = rng.randrange(len(prompts))
                out = c.generate(prompts[i], greedy, stream=rng.random() < 0.5)
                with lock:
                    results.append((i, out.outputs[0].token_ids))
                note("grpc-normal")

    def normal_http(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=http_base, timeout=60) as h:
            while time.monotonic() < stop_at:
                i = rng.randrange(len(prompts))
                r = h.post("/v1/completions", json={"prompt": prompts[i], **greedy})
                if r.status_code != 200:
                    problems.append(f"normal HTTP request got {r.status_code}: {r.text[:200]}")
                    continue
                with lock:
                    results.append((i, r.json()["choices"][0]["text"]))
                note("http-normal")

    def hostile(seed: int) -> None:
        rng = random.Random(seed)
        long = {"temperature": 1.0, "max_tokens": 40, "ignore_eos": True}
        with Client(srv.target, timeout=30) as c, httpx.Client(base_url=http_base, timeout=30) as h:
            while time.monotonic() < stop_at:
                kind = rng.choice(["cancel", "abort", "disconnect", "sse-drop", "bad-json",
                                   "too-long", "bad-proto", "oversized", "huge-n"])
                note(kind)
                try:
                    if kind == "cancel":  # a streaming gRPC call cancelled after its first delta
                        call = c.generate_stream(prompts[rng.randrange(len(prompts))], long)
                        next(iter(call))
                        call.cancel()
                    elif kind == "abort":  # aborted by its label from the same connection
                        label = f"soak-{rng.random()}"
                        call = c.generate_stream(prompts[0], long, request_id=label)
                        next(iter(call))
                        c.abort(label)
                        for _ in call:
                            pass
                    elif kind == "disconnect":  # non-streaming HTTP client that gives up
                        try:
                            h.post("/v1/completions", json={"prompt": prompts[1], **long},
                                   timeout=0.05)
                        except httpx.TimeoutException:
                            pass
                    elif kind == "sse-drop":  # streaming HTTP client that closes mid-stream
                        with h.stream("POST", "/v1/completions",
                                      json={"prompt": prompts[2], "stream": True, **long}) as r:
                            for _ in r.iter_lines():
                                break
                    elif kind == "bad-json":
                        r = h.post("/v1/completions", content=b'{"prompt": [1, 2,',
                                   headers={"content-type": "application/json"})
                        assert r.status_code == 400 and "error" in r.json(), r.text
                    elif kind == "too-long":
                        r = h.post("/v1/completions", json={"prompt": list(range(3, 90)), **greedy})
                        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
                    elif kind == "huge-n":
                        r = h.post("/v1/completions",
                                   json={"prompt": [prompts[0]] * 40, "n": 8, **long})
                        assert r.status_code == 400 and "max_sequences_per_request" in r.text, r.text
                    elif kind == "bad-proto":
                        raw = c.channel.unary_stream("/pagedjax.v1.PagedJax/Generate",
                                                     request_serializer=None,
                                                     response_deserializer=None)
                        try:
                            list(raw(bytes(rng.randrange(256) for _ in range(40)), timeout=10))
                        except grpc.RpcError as e:
                            assert e.code() not in BAD_GRPC, e
                    elif kind == "oversized":  # a raw socket announcing a body it never sends
                        host, port = "127.0.0.1", srv.ports["http_port"]
                        with socket.create_connection((host, port), timeout=5) as s:
                            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: 100000000\r\n\r\n{")
                            reply = s.recv(4096)
                            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
                except grpc.RpcError as e:
                    if e.code() in BAD_GRPC:
                        problems.append(f"{kind}: gRPC {e.code()} {e.details()}")
                except AssertionError as e:
                    problems.append(f"{kind}: {e}")

    def sampler() -> None:
        time.sleep(SOAK_S / 4)
        rss["early"] = _rss_mb()

    workers = [threading.Thread(target=normal_grpc, args=(1,)),
               threading.Thread(target=normal_grpc, args=(2,)),
               threading.Thread(target=normal_http, args=(3,)),
               threading.Thread(target=hostile, args=(4,)),
               threading.Thread(target=hostile, args=(5,)),
               threading.Thread(target=sampler)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=SOAK_S + 120)
    assert not any(w.is_alive() for w in workers), "a soak client hung"
    rss["late"] = _rss_mb()
    print("soak counts", json.dumps(counts), "rss MB", rss)

    assert problems == []
    assert counts.get("grpc-normal", 0) >= 4 and counts.get("http-normal", 0) >= 2, counts
    for i, got in results:
        want = ref[i] if isinstance(got, list) else tok.decode(ref[i])
        assert got == want, f"prompt {i}: {got!r} != {want!r}"
    with Client(srv.target, timeout=30) as c:
        wait_idle(c)
        assert c.health() == "SERVING"
    assert_pool_whole(engine)
    assert engine.block_manager.get_num_free_gpu_blocks() == 48
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= threads_before + 2, threading.enumerate()
    assert rss["late"] - rss["early"] < RSS_GROWTH_BOUND_MB, rss
