"""An earlier commit checked out beside this tree, for the A/B benchmarks that run the same
measurement from both (`host_overhead_ab.py`, `sampler_ab.py`, `stream_delivery.py`)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class BaseTree(NamedTuple):
    path: Path  # the worktree of the base commit
    base_sha: str
    head: str  # this tree's commit
    dirty: bool  # this tree has uncommitted changes to tracked files


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


@contextmanager
def base_tree(commit: str) -> Iterator[BaseTree]:
    """A detached worktree of ``commit`` in a temporary directory, removed on exit."""
    base_sha, head = git("rev-parse", commit), git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(path), base_sha)
        try:
            yield BaseTree(path, base_sha, head, dirty)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           check=False, capture_output=True)
