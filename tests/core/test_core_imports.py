"""pagedjax.core (and the paper's baselines next to it) must stay pure Python: no jax/numpy
import, even transitively."""

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "pagedjax" / "core"
BASELINES = CORE.parent / "baselines"
FORBIDDEN = {"jax", "jaxlib", "numpy", "flax", "torch"}


def test_core_sources_import_no_accelerator_libs():
    files = sorted(CORE.glob("*.py")) + sorted(BASELINES.glob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{f.name} imports {name}"
                if name.startswith("pagedjax"):
                    assert name.startswith(("pagedjax.core", "pagedjax.baselines")), \
                        f"{f.name} imports {name}"


def test_core_loads_without_jax_in_subprocess():
    # Stub the parent package so pagedjax/__init__.py (owned elsewhere, may
    # import jax) is not executed; only the core submodules are loaded.
    code = f"""
import sys, types
pkg = types.ModuleType("pagedjax")
pkg.__path__ = [{str(CORE.parent)!r}]
sys.modules["pagedjax"] = pkg
import pagedjax.core, pagedjax.core.scheduler, pagedjax.core.block_manager, pagedjax.core.policies
bad = {sorted(FORBIDDEN)!r}
loaded = [m for m in bad if m in sys.modules]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True)
