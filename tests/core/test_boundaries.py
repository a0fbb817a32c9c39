"""The package's parts and what each may import (README "Layout").

Runtime checks run in a fresh interpreter, so modules other tests imported cannot hide a
heavy import; static checks read every module's source, so an import inside a function (which
a runtime check only sees when that function runs) is caught too.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prefixkv"

# The public core and the faces: import without torch, cupy or any server client.
CORE = ["prefixkv", "prefixkv.hashing", "prefixkv.prompt", "prefixkv.pool", "prefixkv.manager",
        "prefixkv.events", "prefixkv.stats", "prefixkv.errors", "prefixkv.sizing", "prefixkv.costs"]
FACES = ["prefixkv.cli", "prefixkv.__main__", "prefixkv.console", "prefixkv.argtypes"]
HEAVY = ["torch", "cupy", "transformers", "matplotlib", "redis", "zmq"]

# Which folders may import torch / cupy (the KV layer and what runs models or copies KV).
TORCH_ALLOWED = ("kv", "engine", "integrations", "bench", "tiers")


def _modules_under(folder: pathlib.Path, dotted: str) -> list[str]:
    return sorted(f"{dotted}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__") + [dotted]


def _unimported_after(modules: list[str]) -> dict:
    """In a fresh interpreter: import ``modules``, return which heavy modules got loaded."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_and_faces_import_nothing_heavy():
    assert _unimported_after(CORE + FACES) == []


def test_trace_lab_and_policies_import_nothing_heavy():
    lab = _modules_under(PACKAGE / "sim", "prefixkv.sim")
    policies = _modules_under(ROOT / "policies", "prefixkv.policies")
    assert _unimported_after(lab + policies) == []


def _imports(path: pathlib.Path, source: str | None = None) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, under ``if TYPE_CHECKING``) for every import in ``path``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = path.relative_to(ROOT).with_suffix("").parts
    package = ("prefixkv", *package[1:]) if package[0] == "policies" else package
    package = package[:-1]
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            type_only.update(id(n) for child in node.body for n in ast.walk(child))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in type_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package[:len(package) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{alias.name}" for alias in node.names]
            found += [(name, node.lineno, id(node) in type_only) for name in [base, *names]]
    return found


def _sources(*folders: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def _part(path: pathlib.Path) -> str:
    """The part a source file belongs to: a subpackage's name, ``core`` or ``policies``."""
    if not path.is_relative_to(PACKAGE):
        return path.relative_to(ROOT).parts[0]
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else "core"


def test_torch_and_cupy_only_in_the_kv_layer_and_its_users():
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in _sources(PACKAGE, ROOT / "policies")
             if _part(p) not in TORCH_ALLOWED
             for name, line, type_only in _imports(p)
             if not type_only and name.split(".")[0] in ("torch", "cupy")]
    assert wrong == []


def test_policies_do_not_import_the_manager():
    # check_policy drives the real manager on purpose; the policy classes only see the pool's protocol
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in _sources(ROOT / "policies") if p.name != "check.py"
             for name, line, type_only in _imports(p)
             if not type_only and name.startswith(("prefixkv.manager", "prefixkv.pool", "prefixkv.engine"))]
    assert wrong == []


def test_only_the_kv_layer_loads_the_kernels():
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in _sources(PACKAGE, ROOT / "policies") if _part(p) != "kv"
             for name, line, _ in _imports(p)
             if name.startswith(("prefixkv.kernels", "kernels"))]
    assert wrong == []


def test_argument_converters_belong_to_the_command_line():
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in _sources(PACKAGE) if p.name not in ("cli.py", "__main__.py")
             for name, line, _ in _imports(p)
             if name.startswith(("prefixkv.argtypes", "prefixkv.cli"))]
    assert wrong == []


@pytest.mark.parametrize("source, expect", [
    ("import torch\n", ["torch"]),
    ("def f():\n    from ..kv import storage\n", ["prefixkv.kv", "prefixkv.kv.storage"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", []),
])
def test_the_import_reader_sees_lazy_imports_and_skips_type_only_ones(source, expect):
    names = [name for name, _, type_only in _imports(PACKAGE / "sim" / "probe.py", source)
             if not type_only and not name.startswith("typing")]
    assert names == expect
