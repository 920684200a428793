"""bench/amx_fp32_split.cc, the standalone measurement of float32 matmuls on AMX tiles
(docs/v1-core.md "Issue 15 target by target"): it builds on any x86 host with g++ (AMX flags
given explicitly), and where the host has AMX its three-part split must reach float32
accuracy and its two-part form must not, so the figures it prints mean what the docs say."""

from __future__ import annotations

import pathlib
import platform
import re
import shutil
import subprocess

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "bench" / "amx_fp32_split.cc"
FLAGS = ["-O2", "-std=c++17", "-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16"]


def _host_has_amx() -> bool:
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    return " amx_bf16" in flags and " amx_tile" in flags


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86-64 (the native kernels do too)")
def test_the_amx_split_builds_and_on_amx_hosts_reaches_float32_accuracy(tmp_path):
    exe = tmp_path / "amx_fp32_split"
    subprocess.run(["g++", *FLAGS, str(SRC), "-o", str(exe)], check=True, capture_output=True)
    assert exe.exists()
    if not _host_has_amx():
        return  # built; running needs the tiles (this is what a non-AMX host can check)
    out = subprocess.run([str(exe), "20", "64", "128", "3", "1"], check=True,
                         capture_output=True, text=True).stdout
    err = {m[1].strip(): float(m[2]) for m in re.finditer(
        r"^(.+?)\s+M 20 K 64 N 128: [\d.]+ ms a weight.*?sum\|x\*w\| ([\d.e+-]+)$", out, re.M)}
    assert set(err) == {"fp32 AVX-512 FMA", "AMX bf16 x 6 terms", "AMX bf16 x 3 terms"}, out
    assert err["fp32 AVX-512 FMA"] < 1e-6
    assert err["AMX bf16 x 6 terms"] < 1e-6  # float32's own rounding
    assert err["AMX bf16 x 3 terms"] > 2 * err["AMX bf16 x 6 terms"]  # ~16 bits only
    assert "split alone" in out and "AMX unit alone" in out
