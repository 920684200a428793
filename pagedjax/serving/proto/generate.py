"""Regenerate `pagedjax_pb2.py` / `pagedjax_pb2_grpc.py` from `pagedjax.proto` (needs grpcio-tools).

Run `python -m pagedjax.serving.proto.generate [OUT_DIR]`. The generated modules are committed so
installs need no protoc; a test regenerates into a temporary folder and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the folder holding the `pagedjax` package
PROTO = "pagedjax/serving/proto/pagedjax.proto"


def generate(out_dir: Path) -> list[Path]:
    """Write the two modules into `out_dir/pagedjax/serving/proto/`; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(ROOT / PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    gen = out_dir / "pagedjax" / "serving" / "proto"
    return [gen / "pagedjax_pb2.py", gen / "pagedjax_pb2_grpc.py"]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for p in generate(out):
        print(p)
