"""No import cycles inside the core, the strategies or the adapters, counting imports made inside
functions (a lazy import still ties two modules together). Imports under `if TYPE_CHECKING:` are
annotations only and do not count; importing a package's `__init__` implicitly (as every
submodule import does) does not count either, only imports that name a module do.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"nnscaler_plugins": "nnscaler_plugins", "nnscaler_plugins.strategies": "strategies",
            "nnscaler_plugins.adapters": "adapters"}


def _modules() -> dict[str, str]:
    out = {}
    for package, folder in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                rel = rel[:-len("__init__")].rstrip(".") if rel.endswith("__init__") else rel
                out[package + ("." + rel if rel else "")] = os.path.join(dirpath, f)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.endswith("__init__.py")
        base = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(open(path).read())
        skip = _type_checking_only(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target + "." + a.name if target + "." + a.name in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        edges[name] = deps
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    edges = _edges(_modules())
    found = cycles(edges)
    detail = "\n".join(f"{c}: " + "; ".join(f"{a} -> {sorted(edges[a] & set(c))}" for a in c) for c in found)
    assert not found, "import cycles:\n" + detail


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
