"""Per-kernel GPU resources of one deviceless compile: registers, spills, shared memory.

ptxas reports registers, stack frame and spills per entry function when XLA passes it
``-v`` (``xla_gpu_ptx_compiler_extra_flags``); nvJitLink logs that report through the C++
logger at verbosity 3, so the process must start with ``TF_CPP_VMODULE=nvjitlink=3`` and
``TF_CPP_MIN_LOG_LEVEL=0`` (see :data:`LOG_ENV`) and we read it from file descriptor 2
around the compile. The dynamic shared memory of each launch (what Triton's pipelining
stages take) is only in XLA's thunk sequence, which ``xla_dump_to`` writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from pathlib import Path

LOG_ENV = {"TF_CPP_VMODULE": "nvjitlink=3", "TF_CPP_MIN_LOG_LEVEL": "0"}


@dataclasses.dataclass
class KernelResources:
    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    local_bytes: int = 0
    static_smem: int = 0
    dynamic_smem: int = 0
    threads: int = 0
    grid: tuple[int, ...] = ()

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def smem(self) -> int:
        return self.static_smem + self.dynamic_smem


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_LINK = re.compile(r"Function properties for '([^']+)':\s*\n\s*info\s*: used (\d+) registers"
                   r"[^\n]*?(\d+) stack, (\d+) bytes smem[^\n]*?(\d+) bytes lmem")
_THUNK = re.compile(r"kCustomKernel\s*\[[^\]]*\]\s*(\S+) grid: \[([\d, ]+)\] "
                    r"threads: \[([\d, ]+)\]\s*shared_memory: (\d+) bytes")


def parse_ptxas_log(text: str) -> dict[str, KernelResources]:
    """Registers, stack and spills per entry function from ptxas/nvJitLink verbose output."""
    out: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), KernelResources(m.group(1)))
        elif current is not None and (m := _SPILL.search(line)):
            current.stack_bytes = int(m.group(1))
            current.spill_stores, current.spill_loads = int(m.group(2)), int(m.group(3))
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
    for m in _LINK.finditer(text):
        res = out.setdefault(m.group(1), KernelResources(m.group(1)))
        res.registers = int(m.group(2))
        res.static_smem, res.local_bytes = int(m.group(4)), int(m.group(5))
    return out


def parse_thunks(text: str) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """``name -> (grid, threads per block, dynamic shared memory)`` from a thunk sequence."""
    out = {}
    for m in _THUNK.finditer(text):
        grid = tuple(int(x) for x in m.group(2).split(","))
        threads = 1
        for x in m.group(3).split(","):
            threads *= int(x)
        out[m.group(1)] = (grid, threads, int(m.group(4)))
    return out


def thunk_launches(text: str) -> list[str]:
    """The kernel launched by each thunk of a thunk sequence, in order (a name repeats for
    every launch: the unrolled layers run the same fusions). What a step costs in launches,
    where `parse_thunks` keeps one entry a name."""
    return [m.group(1) for m in _THUNK.finditer(text)]


def compile_launches(lowered) -> list[str]:
    """Compile ``lowered`` for its (compile-only) GPU and return its kernel launches in
    order (`thunk_launches` of the largest thunk sequence XLA dumps: the step's own)."""
    with tempfile.TemporaryDirectory() as tmp:
        lowered.compile(compiler_options={"xla_dump_to": tmp})
        seqs = sorted(Path(tmp).glob("*thunk_sequence.txt"), key=lambda f: f.stat().st_size)
        return thunk_launches(seqs[-1].read_text()) if seqs else []


@contextlib.contextmanager
def _stderr_to(path: Path):
    saved = os.dup(2)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def compile_with_resources(lowered) -> tuple[object, dict[str, KernelResources], str]:
    """Compile ``lowered`` for its (compile-only) GPU; return the executable, the resources
    of every kernel in it, and the raw compiler log (kept for failure messages)."""
    with tempfile.TemporaryDirectory() as tmp:
        log, dump = Path(tmp) / "log", Path(tmp) / "dump"
        options = {"xla_dump_to": str(dump), "xla_gpu_ptx_compiler_extra_flags": "-v"}
        try:
            with _stderr_to(log):
                compiled = lowered.compile(compiler_options=options)
        except Exception as e:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"{e}\n--- compiler log tail ---\n{tail}") from e
        text = log.read_text(errors="replace")
        thunks = {}
        for f in dump.glob("*thunk_sequence.txt"):
            thunks.update(parse_thunks(f.read_text()))
    kernels = parse_ptxas_log(text)
    if not kernels and thunks:
        raise RuntimeError(
            "no ptxas report in the compiler log: start the process with "
            + " ".join(f"{k}={v}" for k, v in LOG_ENV.items()))
    for name, (grid, threads, smem) in thunks.items():
        res = kernels.setdefault(name, KernelResources(name))
        res.grid, res.threads, res.dynamic_smem = grid, threads, smem
    return compiled, kernels, text
