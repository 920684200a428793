"""The committed generated modules must match what grpc_tools produces from the .proto today."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedjax.serving.proto as proto_pkg


def test_generated_code_is_current(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    from pagedjax.serving.proto.generate import generate

    committed = Path(proto_pkg.__file__).parent
    for path in generate(tmp_path):
        assert path.read_text() == (committed / path.name).read_text(), (
            f"{path.name} is stale: run `python -m pagedjax.serving.proto.generate`")
