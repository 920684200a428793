"""What every stage shares: a time budget, a JSON file rewritten after every point, a summary.

A lent GPU's command is killed at its time limit; whatever a stage has measured by then must
already be on disk. :class:`Recorder` therefore rewrites its stage's JSON (write to a temp
file, fsync, rename) after every measured point, and each stage checks its :class:`Budget`
before starting the next unit of work instead of trusting an estimate made up front.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class Budget:
    """Seconds left for a stage; ``reserve`` keeps a tail for writing results and cleanup.

    ``complete``: every part runs whatever the clock says (dry runs: the work is toy-sized
    and the tests assert each part ran; a loaded CI host made the budget cut parts and
    those tests fail, stop 54). The stage's hard limit still stops a hung one."""

    def __init__(self, seconds: float, reserve: float = 0.0, complete: bool = False):
        self.seconds = seconds
        self.start = time.monotonic()
        self.reserve = reserve
        self.complete = complete

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.reserve - self.elapsed()

    def allows(self, needed_s: float) -> bool:
        """Is there time for a unit of work expected to take ``needed_s``?"""
        return self.complete or self.left() >= needed_s

    def sub(self, fraction: float) -> Budget:
        """A child budget of ``fraction`` of what is left now (for a part of a stage)."""
        return Budget(max(0.0, self.left()) * fraction, complete=self.complete)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "item") and callable(x.item):  # numpy / jax scalars
        return x.item()
    return x


def write_json(path: Path, data: Any) -> None:
    """Atomic rewrite: a kill mid-write leaves the previous complete file, never half a one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Recorder:
    """One stage's ``<stage>.json``: metadata, rows appended as measured, a verdict at the end."""

    def __init__(self, out_dir: Path, stage: str, meta: dict[str, Any]):
        self.path = out_dir / f"{stage}.json"
        self.data: dict[str, Any] = {"stage": stage, "status": "running",
                                     "started": datetime.datetime.now().isoformat(timespec="seconds"),
                                     **meta, "summary": []}
        self.t0 = time.monotonic()
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        write_json(self.path, self.data)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def append(self, key: str, row: dict[str, Any]) -> None:
        self.data.setdefault(key, []).append(row)
        self.save()

    def summarize(self, item: str, result: str, verdict: str) -> None:
        """A summary-table row; verdict is "pass", "FAIL", "info" or "skipped"."""
        if verdict not in ("pass", "FAIL", "info", "skipped"):
            raise ValueError(f"bad verdict {verdict!r}")
        self.data["summary"].append({"item": item, "result": result, "verdict": verdict})
        self.save()

    def finish(self, status: str) -> None:
        self.data["status"] = status
        self.save()


def device_meta() -> dict[str, Any]:
    import jax
    import numpy as np

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "numpy": np.__version__, "python": platform.python_version(),
            "host": platform.node()}


def default_out_dir() -> Path:
    """``$OUT`` on a lent GPU (what comes back), else ``bench/results/<device>/gpu_suite``."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    from bench.results_dir import RESULTS, device_tag

    return RESULTS / device_tag() / "gpu_suite"


def summary_table(recs: list[dict[str, Any]], width: int = 160) -> str:
    """One line per summary row of every stage, fitted to ``width`` columns."""
    lines = [f"{'stage':8s} {'item':36s} {'verdict':7s} result", "-" * width]
    for rec in recs:
        rows = rec.get("summary") or [{"item": "(no summary)", "result": rec.get("status", "?"),
                                       "verdict": "FAIL"}]
        for r in rows:
            line = f"{rec['stage']:8s} {r['item'][:36]:36s} {r['verdict']:7s} {r['result']}"
            lines.append(line[:width])
        lines.append(f"{rec['stage']:8s} {'(status, wall time)':36s} {'':7s} "
                     f"{rec.get('status')} in {rec.get('elapsed_s', 0):.0f} s")
    return "\n".join(lines)


def enable_compile_cache(path: str = "/tmp/pagedjax_jax_cache") -> None:
    """Persistent XLA cache: engines rebuilt for another config (or a later call on the same
    warm machine) reuse compiled steps instead of paying seconds per shape again."""
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
