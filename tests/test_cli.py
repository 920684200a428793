"""The demo path end to end: the CLI that `make demo` runs answers a factual question."""

from __future__ import annotations

import subprocess
import sys


def test_cli_generate_answers_paris(demo_gguf):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedjax.cli", "generate", "What is the capital of France?",
         "--max-tokens", "24"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_cli_convert_then_generate_from_checkpoint(demo_gguf, tmp_path):
    dst = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "pagedjax.cli", "convert", str(demo_gguf), str(dst)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from models.checkpoint import load_checkpoint
    from models.gguf_loader import load_gguf

    c1, p1 = load_gguf(demo_gguf)
    c2, p2 = load_checkpoint(dst)
    assert c1 == c2
    import jax
    import numpy as np

    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    proc = subprocess.run([sys.executable, "-m", "pagedjax.cli", "generate", "--model", str(dst),
                           "What is the capital of France?", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
