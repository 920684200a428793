"""`pagedjax serve --engine-process` over the demo model: the engine in a child process gives
the offline engine's outputs, frees its blocks for cancelled and refused requests, and stops
with the server."""

from __future__ import annotations

import asyncio
import os
import re

import grpc
import pytest

from pagedjax.sampling_params import SamplingParams
from tests.serving.conftest import ServerProcess
from tests.serving.test_grpc_e2e import (
    LONG,
    PROMPTS,
    _mixed_params,
    stream_all,
    wait_blocks_free,
)


@pytest.fixture(scope="module")
def core_server(offline, demo_gguf, tmp_path_factory):
    # After `offline` (the shared server launched first, then the reference engine loaded).
    srv = ServerProcess(demo_gguf, tmp_path_factory.mktemp("core"), "--engine-process")
    srv.client  # noqa: B018 - waits until SERVING
    yield srv
    if srv.proc.poll() is None:
        srv.terminate()


def _engine_pid(srv: ServerProcess) -> int:
    m = re.search(r"engine process (\d+) ready", srv.log())
    assert m, srv.log()
    return int(m.group(1))


def test_streams_match_offline_from_the_engine_process(core_server, offline):
    pid = _engine_pid(core_server)
    assert pid != core_server.proc.pid and os.path.exists(f"/proc/{pid}")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    params = [_mixed_params(i) for i in range(24)]
    streamed = stream_all(core_server.target, prompts, params, "p")
    expected = offline.generate(prompts, params, use_tqdm=False)
    for i, (got, want) in enumerate(zip(streamed, expected)):
        assert got.prompt_tokens == len(want.prompt_token_ids)
        assert [(g.text, g.token_ids, g.finish_reason) for g in got.outputs] == \
            [(w.text, w.token_ids, w.finish_reason) for w in want.outputs], i
    assert max(r.num_messages for r in streamed) > 2
    wait_blocks_free(core_server.client)


def test_cancel_and_refusals_free_the_child_blocks(core_server):
    client = core_server.client
    call = client.generate_stream(PROMPTS[1], LONG, request_id="cancel-core")
    next(call)
    assert client.stats().num_free_gpu_blocks < client.stats().num_gpu_blocks
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    wait_blocks_free(client)
    with pytest.raises(grpc.RpcError) as err:  # checked in the child: strict limits
        client.generate(PROMPTS[0], {"max_tokens": 10_000})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in err.value.details()
    wait_blocks_free(client)


def test_http_completion_from_the_engine_process(core_server, offline):
    import openai

    base = f"http://127.0.0.1:{core_server.ports['http_port']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300) as oai:
        chunks = list(oai.completions.create(model=oai.models.list().data[0].id,
                                             prompt=PROMPTS[3], max_tokens=12, temperature=0.0,
                                             stream=True))
    want = offline.generate([PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0.0),
                            use_tqdm=False)[0].outputs[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text


def test_sigterm_stops_the_engine_process_too(core_server):
    pid = _engine_pid(core_server)
    stream = core_server.client.generate_stream(PROMPTS[0], LONG, request_id="in-flight")
    next(stream)
    assert core_server.terminate() == 0, core_server.log()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    log = core_server.log_path.read_text()
    # `terminate` closes the client first, which cancels the stream: aborted in the child.
    assert "drained; " in log and "finished=abort" in log


TEXT_PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
               SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=30),
               SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=20),
               SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                              skip_special_tokens=False),
               SamplingParams(temperature=0.0, max_tokens=16, stop=[".", ","]),  # found in front
               SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, stop=[" the"]),
               # Samples stopped one at a time in the front end, siblings running on.
               SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=24, logprobs=1,
                              stop=[" the", ",", "."]),
               SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=20, min_tokens=3,
                              stop=[" a", "\n", "."], include_stop_str_in_output=True),
               # One output at the end, the best two of four, decoded in the front end.
               SamplingParams(n=2, best_of=4, temperature=1.0, seed=8, max_tokens=16),
               # Logprob streams: their steady steps' rows cross the pipe as columns, the
               # entries built in the front end (`pipe_block`).
               SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=0.8, seed=9, max_tokens=28, logprobs=1)]


def _in_process_deltas(engine, prompts, params) -> list[dict]:
    """Each request's delta outputs from the engine itself, `_merged`."""
    got: dict[str, list] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"ref{i}", prompt, p, output_kind="delta")
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
    return [_merged(got[f"ref{i}"]) for i in range(len(prompts))]


def _merged(outs) -> dict[int, list]:
    """A stream's deltas put together per sample: text, tokens, the last cumulative logprob,
    finish and stop reasons, the logprob entries (None without). Only the last output is
    finished. (The outputs themselves may differ: a stream whose consumer is behind gets its
    pending deltas merged.)"""
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    acc: dict[int, list] = {}
    for o in outs:
        for c in o.outputs:
            a = acc.setdefault(c.index, ["", [], None, None, None, None])
            a[0] += c.text
            a[1] += c.token_ids
            a[2:5] = c.cumulative_logprob, c.finish_reason, c.stop_reason
            if c.logprobs is not None:
                a[5] = (a[5] or []) + c.logprobs
    return acc


def _same(a: dict[int, list], b: dict[int, list]) -> bool:
    """Equal outputs; cumulative logprobs to float noise (a step's rows change the matmul's
    rounding)."""
    def lp_close(x, y):
        return x is None and y is None or x is not None and y is not None and abs(x - y) < 1e-3

    def entries_close(x, y):
        return x is None and y is None or x is not None and y is not None and len(x) == len(
            y) and all(e.keys() == f.keys() and all(lp_close(e[t], f[t]) for t in e)
                       for e, f in zip(x, y))

    return sorted(a) == sorted(b) and all(
        a[i][:2] + a[i][3:5] == b[i][:2] + b[i][3:5] and lp_close(a[i][2], b[i][2])
        and entries_close(a[i][5], b[i][5]) for i in a)


def test_delta_ids_carry_the_delta_tokens_without_text(offline):
    eng = offline.engine
    with pytest.raises(ValueError, match="^output_kind: 'delta_ids'"):
        eng.add_request("s", PROMPTS[0], TEXT_PARAMS[4], output_kind="delta_ids")
    got: dict[str, list] = {}
    for kind in ("delta", "delta_ids"):
        eng.add_request(kind, PROMPTS[2], TEXT_PARAMS[0], output_kind=kind)
    while eng.has_unfinished_requests():
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o.outputs[0])
    ids = {k: [t for c in v for t in c.token_ids] for k, v in got.items()}
    assert ids["delta"] == ids["delta_ids"] and len(ids["delta"]) == 40
    assert "".join(c.text for c in got["delta"]) and not any(c.text for c in got["delta_ids"])


def test_text_free_deltas_decoded_in_the_front_end_match_the_engine(demo_gguf, offline):
    """The parent decodes "delta_ids" streams with the engine's incremental detokenizer and
    looks for stop strings itself, each sample's on its own: what the clients get equals
    the in-process engine's deltas (text, tokens, finish and stop reasons, per sample), and
    the offline engine's outputs."""
    import functools

    from pagedjax.engine import LLMEngine
    from pagedjax.serving.async_engine import AsyncEngine
    from pagedjax.serving.engine_process import EngineProcess
    from tests.serving.conftest import engine_kwargs

    proc = EngineProcess(functools.partial(LLMEngine.from_model, str(demo_gguf),
                                           **engine_kwargs()))
    decoded: list[int] = []
    decode = proc._decode
    proc._decode = lambda outs: (decoded.append(len(outs)), decode(outs))[1]
    aeng = AsyncEngine(proc).start()
    num = 2 * len(TEXT_PARAMS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num)]
    params = [TEXT_PARAMS[i % len(TEXT_PARAMS)] for i in range(num)]
    try:
        async def run():
            async def one(i):
                runs = []
                # A stop-string request runs twice under one id, the second at once: the
                # child's outputs past the first one's stop must not reach the second.
                for _ in range(2 if params[i].has_stop_strings else 1):
                    stream = await aeng.add_request_async(f"t{i}", prompts[i], params[i],
                                                          delta=True)
                    runs.append(_merged([o async for o in stream]))
                assert all(_same(r, runs[0]) for r in runs), runs
                return runs[0]

            return await asyncio.gather(*(one(i) for i in range(num)))

        streamed = asyncio.run(run())
    finally:
        aeng.shutdown()
        assert proc.close() == 0
    for i, (got, want) in enumerate(zip(streamed,
                                        _in_process_deltas(offline.engine, prompts, params))):
        assert _same(got, want), (i, got, want)
    expected = offline.generate(prompts, params, use_tqdm=False)
    for i, (got, want) in enumerate(zip(streamed, expected)):
        assert [(got[c.index][0], got[c.index][3], got[c.index][4]) for c in want.outputs] == \
            [(c.text, c.finish_reason, c.stop_reason) for c in want.outputs], i
    assert sum(decoded) > 0 and not proc._texts and not proc._dropping  # nothing left behind
    assert proc.num_front_stops >= 2  # stop strings found in the front end, mid-stream
    assert proc.num_front_sample_stops >= 2  # samples stopped there, siblings running on
