"""Run `run_server` on a background thread's event loop (fake or real engine, no subprocess)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from pagedjax.serving.server import ServerOptions, new_event_loop, run_server


class InProcessServer:
    """gRPC and a metrics port on ephemeral ports unless ``opts`` say otherwise (``port=None,
    metrics_port=None, http_port=0``: HTTP alone, as `pagedjax serve MODEL`)."""

    def __init__(self, engine, tmp: Path, **opts):
        self.port_file = tmp / "ports.json"
        self.opts = ServerOptions(**{"port": 0, "metrics_port": 0, "grace_s": 2.0, **opts,
                                     "port_file": str(self.port_file)})
        self.engine = engine
        self.loop = new_event_loop()  # uvloop's, as `pagedjax serve` runs
        self.stop = asyncio.Event()
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.rc = self.loop.run_until_complete(run_server(self.opts, self.engine, self.stop))

    def start(self, timeout: float = 30.0) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.port_file.exists() or not self.port_file.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("server did not bind")
            time.sleep(0.02)
        self.ports = json.loads(self.port_file.read_text())
        self.target = f"127.0.0.1:{self.ports['port']}" if "port" in self.ports else None
        return self

    def close(self) -> int | None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)
        return self.rc
