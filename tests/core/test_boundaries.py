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

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefixkv"

# The public core and the faces: import without torch, cupy or any server client.
CORE = ["prefixkv", "prefixkv.hashing", "prefixkv.prompt", "prefixkv.pool", "prefixkv.manager",
        "prefixkv.events", "prefixkv.stats", "prefixkv.errors", "prefixkv.sizing", "prefixkv.costs"]
FACES = ["prefixkv.cli", "prefixkv.__main__", "prefixkv.console", "prefixkv.argtypes"]
# numba too: it compiles the flat index (prefixkv.flat), which the manager loads only when it builds one
HEAVY = ["torch", "cupy", "transformers", "matplotlib", "redis", "zmq", "numba"]

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


def _imports(path: pathlib.Path, source: str | None = None, *, at_import: bool = False) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, under ``if TYPE_CHECKING``) for every import in ``path``;
    ``at_import``: only those that run when the module is imported (not inside a function)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    if at_import:
        def shallow(node):
            yield node
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    yield from shallow(child)
        walk = shallow
    else:
        walk = ast.walk
    package = path.relative_to(ROOT).with_suffix("").parts
    package = ("prefixkv", *package[1:]) if package[0] == "policies" else package
    package = package[:-1]
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            type_only.update(id(n) for child in node.body for n in ast.walk(child))
    found = []
    for node in walk(tree):
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


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("prefixkv", "policies", *parts[1:]) if parts[0] == "policies" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(paths: list[pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``paths`` it imports (anywhere in it, a function included; not
    type-only imports). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
    else to ``pkg`` (whose ``__init__`` then runs for the name); the parent package a submodule's
    import runs first is Python's loading order, not a dependency, and is no edge."""
    modules = {_module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        type_only = {id(n) for node in ast.walk(tree)
                     if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
                     for child in node.body for n in ast.walk(child)}
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = ".".join(package[:len(package) - node.level + 1])
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in modules else base)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    graph = _import_graph(_sources(PACKAGE, ROOT / "policies"))
    assert len(graph) > 100 and "prefixkv.policies.check" in graph["prefixkv.policies"]
    assert _cycles(graph) == []


@pytest.mark.parametrize("graph, expect", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}, [["a", "b"], ["c", "d"]]),
])
def test_the_cycle_finder_finds_cycles(graph, expect):
    assert sorted(_cycles(graph)) == expect


def test_the_core_imports_only_the_core_and_policies():
    """What ``import prefixkv`` runs: the top-level modules import no part (flat, sim, tiers, ...) when
    they load; a part a call needs (the flat index for ``index='flat'``) is imported by that call."""
    core = {_module_name(p) for p in PACKAGE.glob("*.py")}
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in sorted(PACKAGE.glob("*.py")) if p.stem not in ("cli", "__main__")
             for name, line, type_only in _imports(p, at_import=True)
             if not type_only and name.startswith("prefixkv.") and not name.startswith("prefixkv.policies")
             and name not in core and name.rsplit(".", 1)[0] not in core]       # (a module, or a name in one)
    assert wrong == []
    assert _imports(PACKAGE / "sim" / "probe.py", "def f():\n    from .. import flat\n", at_import=True) == []


NUMBA_BLOCKED = """
import sys
sys.modules["numba"] = None         # as where numba is not installed: importing it raises ImportError
import prefixkv
mgr = prefixkv.KVCacheManager(64, 16)
assert mgr.admit("r", list(range(40))) == 0
mgr.free("r")
assert mgr.admit("s", list(range(40))) == 32
mgr.check_invariants()
print(type(mgr.pool).__name__, sorted(m for m in ("numba", "prefixkv.flat", "prefixkv.sim") if sys.modules.get(m)))
"""


def test_a_manager_runs_where_numba_is_missing():
    out = subprocess.run([sys.executable, "-c", NUMBA_BLOCKED], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    pool, loaded = out.stdout.split(maxsplit=1)
    # the dict index serves; the flat index's package may load (it reports numba missing), numba not
    assert pool == "BlockPool" and loaded.strip() in ("[]", "['prefixkv.flat']"), out.stdout


def test_the_core_imports_no_tier_module_even_lazily():
    """The manager drives its host tier (``prefixkv.host_tier``, in the core) and knows the tiers below
    it only through the protocol ``prefixkv.tier_stack`` calls: no top-level module but the command
    line imports ``prefixkv.tiers``, at load time or inside a function."""
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {name}"
             for p in sorted(PACKAGE.glob("*.py")) if p.stem not in ("cli", "__main__")
             for name, line, _ in _imports(p, at_import=False)
             if name == "prefixkv.tiers" or name.startswith("prefixkv.tiers.")]
    assert wrong == []
