"""The project's import graph, read from its source (imports inside functions included, those under
`if TYPE_CHECKING:` left out): what tests/test_import_cycles.py and tests/test_layers.py check."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"nnscaler_plugins": "nnscaler_plugins", "nnscaler_plugins.strategies": "strategies",
            "nnscaler_plugins.adapters": "adapters"}


def modules() -> dict[str, str]:
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


def type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def edges(mods: dict[str, str]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.endswith("__init__.py")
        base = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(open(path).read())
        skip = type_checking_only(tree)
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
