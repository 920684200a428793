"""Health transitions and SIGTERM graceful shutdown of a real server with requests in flight."""

from __future__ import annotations

import time

import grpc

from tests.serving.conftest import ServerProcess


def _poll(fn, want, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while (got := fn()) != want:
        assert time.monotonic() < deadline, f"still {got!r}, wanted {want!r}"
        time.sleep(0.05)


def test_health_and_graceful_shutdown(demo_gguf, tmp_path):
    from pagedjax.serving.client import Client

    # Grace long enough for 10 tokens on a loaded CI worker (at 4 s the short request was once
    # aborted); the long request outlasts it by far.
    srv = ServerProcess(demo_gguf, tmp_path, "--grace", "10", "--max-model-len", "4096")
    try:
        srv.wait_bound()
        probe = Client(srv.target, timeout=30)
        assert probe.health() == "NOT_SERVING"  # bound, still loading the model
        with grpc.insecure_channel(srv.target) as ch:
            from pagedjax.serving.proto import pagedjax_pb2 as pb
            from pagedjax.serving.proto import pagedjax_pb2_grpc as pb_grpc

            try:
                pb_grpc.PagedJaxStub(ch).GetStats(pb.StatsRequest(), timeout=10)
                early = None
            except grpc.RpcError as exc:
                early = exc.code()
        client = srv.client  # waits for SERVING
        if early is not None:
            assert early == grpc.StatusCode.UNAVAILABLE
        assert client.health() == client.health("pagedjax.v1.PagedJax") == "SERVING"

        short = client.generate_stream("Once upon a time", {"temperature": 0.0, "max_tokens": 10,
                                                            "ignore_eos": True})
        long = client.generate_stream("The quick brown fox", {"temperature": 0.0, "max_tokens": 3000,
                                                              "ignore_eos": True})
        first_short, first_long = next(short), next(long)
        srv.proc.send_signal(15)
        _poll(probe.health, "NOT_SERVING")
        try:
            client.generate("late", {"max_tokens": 2})
            raise AssertionError("a request was accepted while draining")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        short_msgs = [first_short, *short]
        long_msgs = [first_long, *long]
        assert short_msgs[-1].outputs[0].finish_reason == "length"
        assert sum(len(m.outputs[0].token_ids) for m in short_msgs if m.outputs) == 10
        assert long_msgs[-1].outputs[0].finish_reason == "abort"  # grace ran out
        assert srv.proc.wait(60) == 0
        log = srv.log()
        assert "drained; 1 requests aborted" in log and "finished=length" in log
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
