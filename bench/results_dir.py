"""Where benchmark results go: `bench/results/<device tag>/` (e.g. `cpu`, `nvidia_h100_80gb_hbm3`).

Imported by the benchmark scripts, which run as `python bench/<name>.py` (bench/ on sys.path).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def device_tag() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", dev.device_kind.lower()).strip("_")
