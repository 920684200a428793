"""The real server over the demo model: parity with offline generation, cancellation, errors, metrics."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.client import AsyncClient

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Once upon a time", "def fibonacci(n):", "The quick brown fox",
           "Explain photosynthesis in one sentence.", "My favourite colour is"]


def wait_blocks_free(client, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.num_in_flight == 0 and s.num_free_gpu_blocks == s.num_gpu_blocks:
            return s
        assert time.monotonic() < deadline, f"blocks not freed: {s}"
        time.sleep(0.1)


def _mixed_params(i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=4 + i % 13)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=12)
    if kind == 2:
        return SamplingParams(temperature=0.0, max_tokens=16, stop=[".", "\n"], logprobs=2)
    return SamplingParams(n=2, temperature=1.0, top_k=20, seed=7 * i, max_tokens=8)


def stream_all(target: str, prompts: list[str], params: list[SamplingParams], prefix: str):
    """Every prompt streamed at once over gRPC, request ids ``prefix0``, ``prefix1``, ..."""
    async def run():
        async with AsyncClient(target, timeout=300) as ac:
            return await asyncio.gather(*(ac.generate(p, sp, request_id=f"{prefix}{i}",
                                                      stream=True)
                                          for i, (p, sp) in enumerate(zip(prompts, params))))

    return asyncio.run(run())


def test_32_concurrent_streams_match_offline(server, offline):
    client = server.client
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    params = [_mixed_params(i) for i in range(32)]
    streamed = stream_all(server.target, prompts, params, "c")
    expected = offline.generate(prompts, params, use_tqdm=False)
    for i, (got, want) in enumerate(zip(streamed, expected)):
        assert got.request_id == f"c{i}" and got.prompt_tokens == len(want.prompt_token_ids)
        assert len(got.outputs) == len(want.outputs), i
        for g, w in zip(got.outputs, want.outputs):
            # the streamed deltas, concatenated by the client, equal the offline final text
            assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason), i
            if w.logprobs is not None:
                assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
                for ge, we in zip(g.logprobs, w.logprobs):
                    assert [ge[k] for k in sorted(ge)] == pytest.approx([we[k] for k in sorted(we)], abs=1e-3)
    assert max(r.num_messages for r in streamed) > 2  # really streamed, not one final message
    wait_blocks_free(client)


LONG = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}


def test_cancel_mid_stream_frees_blocks(server):
    client = server.client
    call = client.generate_stream(PROMPTS[1], LONG, request_id="cancel-me")
    first = next(call)
    assert first.request_id == "cancel-me"
    busy = client.stats()
    assert busy.num_in_flight == 1 and busy.num_free_gpu_blocks < busy.num_gpu_blocks
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_blocks_free(client)


def test_deadline_frees_blocks(server):
    client = server.client
    with pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPTS[2], LONG, timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_blocks_free(client)


BAD = [
    ("", {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ([1] * 256, {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ([-1, 5], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ([10**9], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ("hi", {"temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("hi", {"top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("hi", {"top_k": -5}, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("hi", {"min_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ("hi", {"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("hi", {"min_tokens": 9, "max_tokens": 4}, grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    ("hi", {"presence_penalty": 3.0}, grpc.StatusCode.INVALID_ARGUMENT, "presence_penalty"),
    ("hi", {"frequency_penalty": -3.0}, grpc.StatusCode.INVALID_ARGUMENT, "frequency_penalty"),
    ("hi", {"repetition_penalty": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty"),
    ("hi", {"logprobs": 50}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ("hi", {"stop": ["ok", ""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("hi", {"n": 0}, grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ("hi", {"n": 3, "best_of": 2, "temperature": 1.0}, grpc.StatusCode.INVALID_ARGUMENT, "best_of"),
    ("hi", {"n": 2, "temperature": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "best_of"),
    ("hi", {"n": 1000, "temperature": 1.0}, grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ("hi", {"length_penalty": 2.0}, grpc.StatusCode.INVALID_ARGUMENT, "length_penalty"),
    ("hi", {"use_beam_search": True, "best_of": 1, "temperature": 0.0}, grpc.StatusCode.INVALID_ARGUMENT,
     "best_of"),
    ("hi", {"prompt_logprobs": 1}, grpc.StatusCode.UNIMPLEMENTED, "prompt_logprobs"),
    ("hi", {"guided_decoding": {"json": {"type": "objectx"}}}, grpc.StatusCode.INVALID_ARGUMENT,
     "guided_decoding.json"),
    ("hi", {"guided_decoding": {"regex": "[a"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "guided_decoding.regex"),
    ("hi", {"logit_bias": {10**6: 1.0}}, grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("hi", {"logit_bias": {5: 200.0}}, grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("hi", {"allowed_token_ids": [10**6]}, grpc.StatusCode.INVALID_ARGUMENT,
     "allowed_token_ids"),
]


def test_priority_needs_the_priority_policy(server):
    """This server schedules FCFS: a non-zero priority is refused, naming the field (as vLLM
    refuses a priority its scheduler would ignore); 0 is the default and accepted."""
    with pytest.raises(grpc.RpcError) as e:
        server.client.generate("hi", {"max_tokens": 2}, priority=3)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("priority"), e.value.details()
    assert server.client.generate("hi", {"max_tokens": 2}, priority=0).outputs


@pytest.mark.parametrize("prompt,params,code,field", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs(server, prompt, params, code, field):
    with pytest.raises(grpc.RpcError) as e:
        server.client.generate(prompt, params)
    assert e.value.code() == code
    assert e.value.details().startswith(field), e.value.details()


def test_abort_unknown_duplicate_then_good_request(server):
    client = server.client
    with pytest.raises(grpc.RpcError) as e:
        client.abort("no-such-request")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    call = client.generate_stream(PROMPTS[3], LONG, request_id="dup")
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hello", {"max_tokens": 2}, request_id="dup")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert client.abort("dup") == ["dup"]
    last = list(call)[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    wait_blocks_free(client)
    good = client.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 6})
    assert good.outputs[0].finish_reason in ("length", "stop") and good.outputs[0].text


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"[{v}]" for v in s.labels.values() if v and s.labels.get("le") is None)
            out[key] = s.value
    return out


def test_metrics_consistent_with_requests(server):
    client = server.client
    before = _scrape(server.ports["metrics_port"])
    sent = [client.generate(p, {"temperature": 0.0, "max_tokens": k, "ignore_eos": True})
            for p, k in zip(PROMPTS[:3], (3, 5, 7))]
    after = _scrape(server.ports["metrics_port"])
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
    assert d("pagedjax_requests_total[length]") == 3
    assert d("pagedjax_generation_tokens_total") == 15
    assert d("pagedjax_prompt_tokens_total") == sum(r.prompt_tokens for r in sent)
    for h in ("pagedjax_time_to_first_token_seconds", "pagedjax_e2e_request_latency_seconds",
              "pagedjax_time_per_output_token_seconds"):
        assert d(f"{h}_count") == 3 and d(f"{h}_sum") > 0
    assert after["pagedjax_num_requests_running"] == 0 and after["pagedjax_kv_cache_usage_ratio"] == 0
    # The same under vLLM's names, labelled with the served model's name.
    m = f"[{client.model_info().model}]"
    assert d(f"vllm:request_success_total[length]{m}") == 3
    assert d(f"vllm:generation_tokens_total{m}") == 15
    assert d(f"vllm:prompt_tokens_total{m}") == sum(r.prompt_tokens for r in sent)
    assert d(f"vllm:prefix_cache_queries_total{m}") == sum(r.prompt_tokens for r in sent)
    assert d(f"vllm:prefix_cache_hits_total{m}") == sum(r.cached_tokens for r in sent)
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens"):
        assert d(f"{h}_count{m}") == 3, h
    assert d(f"vllm:request_generation_tokens_sum{m}") == 15
    assert d(f"vllm:inter_token_latency_seconds_count{m}") == 2 + 4 + 6  # every gap
    assert after[f"vllm:num_requests_running{m}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{m}"] == 0


def test_model_info_and_reflection(server):
    info = server.client.model_info()
    assert (info.max_model_len, info.block_size, info.num_gpu_blocks, info.tensor_parallel_size) == \
        (256, 16, 256, 1)
    assert info.dtype and info.vocab_size > 0
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    services = ProtoReflectionDescriptorDatabase(server.client.channel).get_services()
    assert "pagedjax.v1.PagedJax" in services and "grpc.health.v1.Health" in services


def test_beam_search_matches_offline(server, offline):
    sp = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=6)
    want = offline.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    got = server.client.generate(PROMPTS[0], sp)
    assert [(c.text, c.token_ids) for c in got.outputs] == [(o.text, o.token_ids) for o in want.outputs]


def test_structured_outputs_over_grpc(server):
    import json

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "year": {"type": "integer", "minimum": 1000,
                                                        "maximum": 2100}},
              "required": ["city", "year"], "additionalProperties": False}
    res = server.client.generate("Facts as JSON:", {"max_tokens": 40, "temperature": 0.8,
                                                    "seed": 2, "n": 2,
                                                    "guided_decoding": {"json": schema}})
    for o in res.outputs:
        value = json.loads(o.text)
        assert set(value) == {"city", "year"} and value["city"] in ("Paris", "Rome")
    res = server.client.generate("Pick:", {"max_tokens": 8, "temperature": 1.0, "n": 3,
                                           "guided_decoding": {"choice": ["left", "right"]}})
    assert {o.text for o in res.outputs} <= {"left", "right"}
    res = server.client.generate("The sky is", {"max_tokens": 4, "temperature": 0.0,
                                                "logit_bias": {1234: 100.0}})
    assert res.outputs[0].token_ids == [1234] * 4
    res = server.client.generate("The sky is", {"max_tokens": 6, "temperature": 1.0, "seed": 1,
                                                "allowed_token_ids": [11, 12, 13]})
    assert set(res.outputs[0].token_ids) <= {11, 12, 13}
    wait_blocks_free(server.client)
