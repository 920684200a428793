"""GPUs' two-stage top-k on logits split over devices by vocabulary (a TP runner): the same
tokens and logprobs as the one-stage sampler (`chunked_top_k_script.py`, 2 forced host
devices in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chunked_sampler_on_vocab_sharded_logits():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.parallel.chunked_top_k_script"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
