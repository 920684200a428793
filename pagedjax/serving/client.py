"""Python clients of the pagedjax gRPC service: `Client` (threads) and `AsyncClient` (asyncio).

`generate_stream` yields raw `GenerateResponse` deltas (cancel the call to abort the request);
`generate` returns a merged `GenerateResult`. Both accept a text prompt or token ids and sampling
params as a `SamplingParams` or a dict of its fields.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.convert import params_to_proto
from pagedjax.serving.proto import pagedjax_pb2 as pb
from pagedjax.serving.proto import pagedjax_pb2_grpc as pb_grpc

Params = SamplingParams | dict | None


@dataclasses.dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class GenerateResult:
    request_id: str = ""
    outputs: list[Completion] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_messages: int = 0


def make_request(prompt: str | Sequence[int], params: Params = None, request_id: str = "",
                 stream: bool = True, priority: int = 0) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, params=params_to_proto(params), stream=stream,
                             priority=priority)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    return req


class Collector:
    """Merges streamed deltas into a `GenerateResult`."""

    def __init__(self):
        self.result = GenerateResult()
        self._by_index: dict[int, Completion] = {}

    def add(self, resp: pb.GenerateResponse) -> None:
        r = self.result
        r.request_id, r.prompt_tokens = resp.request_id, resp.prompt_tokens
        r.cached_tokens = resp.cached_tokens
        r.num_messages += 1
        for d in resp.outputs:
            c = self._by_index.setdefault(d.index, Completion(d.index))
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(dict(zip(lp.token_ids, lp.logprobs)) for lp in d.logprobs)
            if d.finish_reason:
                c.finish_reason = d.finish_reason
            which = d.WhichOneof("stop_reason")
            if which:
                c.stop_reason = getattr(d, which)
            if d.HasField("cumulative_logprob"):
                c.cumulative_logprob = d.cumulative_logprob
        r.outputs = [self._by_index[i] for i in sorted(self._by_index)]


def collect(responses: Iterable[pb.GenerateResponse]) -> GenerateResult:
    c = Collector()
    for resp in responses:
        c.add(resp)
    return c.result


# Each client gets its own connection (gRPC otherwise shares one per target in a process):
# the server scopes request ids to the connection, so two clients never see each other's.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def _auth_metadata(api_key: str | None) -> tuple | None:
    """`Authorization: Bearer` metadata for a server started with --api-key (None: none)."""
    key = api_key if api_key is not None else os.environ.get("PAGEDJAX_API_KEY")
    return (("authorization", f"Bearer {key}"),) if key else None


class Client:
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, target: str, timeout: float | None = None, api_key: str | None = None):
        self.target = target
        self.timeout = timeout
        self.metadata = _auth_metadata(api_key)
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.PagedJaxStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate_stream(self, prompt: str | Sequence[int], params: Params = None, request_id: str = "",
                        timeout: float | None = None, priority: int = 0
                        ) -> Iterator[pb.GenerateResponse]:
        """The streaming call: iterate it for deltas, `.cancel()` it to abort the request."""
        return self.stub.Generate(make_request(prompt, params, request_id, True, priority),
                                  timeout=timeout or self.timeout, metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], params: Params = None, request_id: str = "",
                 timeout: float | None = None, stream: bool = False,
                 priority: int = 0) -> GenerateResult:
        call = self.stub.Generate(make_request(prompt, params, request_id, stream, priority),
                                  timeout=timeout or self.timeout, metadata=self.metadata)
        return collect(call)

    def abort(self, *request_ids: str) -> list[str]:
        return list(self.stub.Abort(pb.AbortRequest(request_ids=request_ids),
                                    timeout=self.timeout, metadata=self.metadata).aborted)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def stats(self) -> pb.Stats:
        return self.stub.GetStats(pb.StatsRequest(), timeout=self.timeout, metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """'SERVING' | 'NOT_SERVING' | ... ; 'UNAVAILABLE' if the server cannot be reached."""
        try:
            resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {self.target} not SERVING after {timeout}s")
            time.sleep(0.1)


class AsyncClient:
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, target: str, timeout: float | None = None, api_key: str | None = None):
        self.target = target
        self.timeout = timeout
        self.metadata = _auth_metadata(api_key)
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.PagedJaxStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate_stream(self, prompt: str | Sequence[int], params: Params = None, request_id: str = "",
                        timeout: float | None = None, priority: int = 0
                        ) -> AsyncIterator[pb.GenerateResponse]:
        """The streaming call: `async for` it, `.cancel()` it to abort the request."""
        return self.stub.Generate(make_request(prompt, params, request_id, True, priority),
                                  timeout=timeout or self.timeout, metadata=self.metadata)

    async def generate(self, prompt: str | Sequence[int], params: Params = None, request_id: str = "",
                       timeout: float | None = None, stream: bool = False,
                       priority: int = 0) -> GenerateResult:
        c = Collector()
        async for resp in self.stub.Generate(make_request(prompt, params, request_id, stream,
                                                          priority),
                                             timeout=timeout or self.timeout, metadata=self.metadata):
            c.add(resp)
        return c.result

    async def abort(self, *request_ids: str) -> list[str]:
        resp = await self.stub.Abort(pb.AbortRequest(request_ids=request_ids),
                                     timeout=self.timeout, metadata=self.metadata)
        return list(resp.aborted)

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeout,
                                            metadata=self.metadata)

    async def stats(self) -> pb.Stats:
        return await self.stub.GetStats(pb.StatsRequest(), timeout=self.timeout, metadata=self.metadata)

    async def health(self, service: str = "") -> str:
        try:
            resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
