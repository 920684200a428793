"""The deviceless GPU compile tier runs in `.venv-aot` (jax + CUDA plugin, CPU platform).

`make test` runs this folder there with JAX_PLATFORMS=cpu and the nvJitLink log level set
(pagedjax.aot.resources.LOG_ENV); the main suite ignores it. Run by hand:
`JAX_PLATFORMS=cpu TF_CPP_VMODULE=nvjitlink=3 TF_CPP_MIN_LOG_LEVEL=0 .venv-aot/bin/pytest tests/aot`.
"""

from __future__ import annotations

import os

from pagedjax.aot.resources import LOG_ENV

missing = [k for k, v in {**LOG_ENV, "JAX_PLATFORMS": "cpu"}.items() if os.environ.get(k) != v]
if missing:
    raise RuntimeError(f"tests/aot needs {missing} set before jax loads (see this conftest)")
