"""A real `pagedjax serve` subprocess on 127.0.0.1 with ephemeral ports and the demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedjax.serving.client import Client

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--num-gpu-blocks", "256", "--max-model-len", "256", "--max-num-seqs", "32"]


class ServerProcess:
    """Launch without waiting (the test can load its reference model meanwhile), then `wait_ready`."""

    def __init__(self, model: Path, tmp: Path, *extra: str):
        self.port_file = tmp / "ports.json"
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        # `vllm serve`'s shape: the model positional, --port for HTTP; gRPC and a separate
        # metrics port on request.
        cmd = [sys.executable, "-m", "pagedjax", "serve", str(model), "--port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--port-file", str(self.port_file),
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--enable-prompt-tokens-details", *ENGINE_ARGS, *extra]
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   PAGEDJAX_SERVER_DEV_MODE="1")  # /reset_prefix_cache
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self._client: Client | None = None

    def wait_bound(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not bind:\n{self.log()}")
            time.sleep(0.05)
        self.ports = json.loads(self.port_file.read_text())
        self.target = f"127.0.0.1:{self.ports['port']}"
        return self.ports

    @property
    def client(self) -> Client:
        if self._client is None:
            self.wait_bound()
            self._client = Client(self.target, timeout=120)
            self._client.wait_ready(240)
        return self._client

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def terminate(self, timeout: float = 60.0) -> int:
        if self._client is not None:
            self._client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self._log.close()


def engine_kwargs() -> dict:
    it = iter(ENGINE_ARGS)
    return {k.lstrip("-").replace("-", "_"): int(v) for k, v in zip(it, it)}


@pytest.fixture(scope="session")
def server(demo_gguf, tmp_path_factory):
    """One server (gRPC + HTTP over one engine) shared by the e2e modules: startup is the slow part."""
    srv = ServerProcess(demo_gguf, tmp_path_factory.mktemp("server"))
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="session")
def offline(server, demo_gguf):
    """The offline reference `LLM`, loaded while the server process loads (server launched first)."""
    from pagedjax.llm import LLM

    return LLM(str(demo_gguf), **engine_kwargs())


@pytest.fixture(scope="module")
def oai(server):
    """The official `openai` client on the shared server's HTTP port."""
    import openai

    server.client  # noqa: B018 - waits until SERVING
    base = f"http://127.0.0.1:{server.ports['http_port']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300) as client:
        yield client
