"""The core's parts import only downward, counting imports made inside functions.

Data flows one way (capture -> plan -> lower -> codegen/compile -> runtime -> adapters), and so do
imports: a part may import its own modules and the parts of the layers below it, never a part above
or beside it. `LAYERS` is the contract, lowest first; CONTRIBUTING.md draws it. Imports under
`if TYPE_CHECKING:` are annotations only and do not count. The strategies and the adapters are
plugins above the whole core: the core never imports them, and they import only the core's public
names (no `_private` name of the project is imported from another file, tests and benchmarks
included).
"""
from __future__ import annotations

import ast
import os

from import_graph import ROOT, modules, type_checking_only

#: Parts of `nnscaler_plugins`, lowest layer first. A part is a subpackage or a top-level module.
LAYERS: list[frozenset[str]] = [
    frozenset({"errors", "progress", "units", "svg", "hookspecs", "plugins", "framework_imports", "batches",
               "lifted_closure", "block_mask_input",
               "outputs", "layout"}),  # base: no stage of the flow
    frozenset({"kernels"}),  # device code generated programs call (collectives, group-aware kernels)
    frozenset({"capture"}),
    frozenset({"rules"}),
    frozenset({"plan"}),
    frozenset({"lower"}),
    frozenset({"passes"}),  # parallelizations over the mesh: what strategies and the search compose
    frozenset({"render"}),
    frozenset({"codegen"}),
    frozenset({"search"}),
    frozenset({"compiler"}),  # lower + codegen -> one artifact per rank
    frozenset({"runtime"}),
    frozenset({"checkpoint"}),
    frozenset({"session"}),  # one job through the stages (the adapters keep one)
    frozenset({"api"}),
    frozenset({"cli"}),
    frozenset({""}),  # nnscaler_plugins/__init__.py: the public names
]
PLUGINS = ("nnscaler_plugins.strategies", "nnscaler_plugins.adapters")
# Parts of the core whose own tests and stages run nothing of the model: the runtime may not import
# them even though they are below it (the issue of runs that recompile themselves).
NOT_FROM_RUNTIME = ("capture", "codegen", "search")
BASE = LAYERS[0]


def part_of(module: str) -> str:
    """'nnscaler_plugins.lower.lowering' -> 'lower'; the package itself -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def level(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise KeyError(f"part {part!r} of nnscaler_plugins is in no layer of tests/test_layers.py: add it where it "
                   "belongs in the flow")


def imports(path: str, module: str, mods: dict[str, str]) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names imported from it) for every import of a project module."""
    is_package = path.endswith("__init__.py")
    base = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(open(path).read())
    skip = type_checking_only(tree)
    out = []
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
            for a in node.names:
                full = target + "." + a.name
                if full in mods:
                    out.append((full, node.lineno, []))
                else:
                    out.append((target, node.lineno, [a.name]))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, []) for a in node.names]
    return [(t, n, names) for t, n, names in out if t.startswith("nnscaler_plugins") or t.split(".")[0] in
            ("strategies", "adapters", "tests")]


def violations(mods: dict[str, str]) -> list[str]:
    bad = []
    for module, path in sorted(mods.items()):
        core = not module.startswith(PLUGINS)
        for target, line, _ in imports(path, module, mods):
            where = f"{os.path.relpath(path, ROOT)}:{line} imports {target}"
            if target.startswith(PLUGINS):
                if core:
                    bad.append(f"{where}: the core never imports strategies/ or adapters/ (register through hooks)")
                elif target.split(".")[:2] != module.split(".")[:2]:
                    bad.append(f"{where}: strategies and adapters are separate plugins; share through the core")
                continue
            if not core:
                continue
            mine, theirs = part_of(module), part_of(target)
            if mine == theirs or (mine in BASE and theirs in BASE):
                continue  # inside a part (or among base modules: their module graph is acyclic, test_import_cycles)
            if mine == "runtime" and theirs in NOT_FROM_RUNTIME:
                bad.append(f"{where}: the runtime runs what the compile stage made; it imports no {theirs}/")
            elif level(theirs) >= level(mine):
                bad.append(f"{where}: {mine or '__init__'} (layer {level(mine)}) may import only layers below it; "
                           f"{theirs or '__init__'} is layer {level(theirs)}")
    return bad


def test_layers_import_only_downward():
    bad = violations(modules())
    assert not bad, f"{len(bad)} import(s) against the layers:\n" + "\n".join(bad)


def _project_module_aliases(tree: ast.AST) -> set[str]:
    """Names a file binds to modules of the project (`from nnscaler_plugins import api`,
    `import nnscaler_plugins.session as s`): `alias._private` on them is a private name used across files."""
    mods = modules()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnscaler_plugins"):
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    names.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nnscaler_plugins") and a.asname:
                    names.add(a.asname)
    return names


def test_no_private_name_imported_across_files():
    """`from nnscaler_plugins.x import _y` anywhere (core, plugins, tests, benchmarks, recipes): a private
    name used from another file is a missing public one."""
    bad = []
    folders = ("nnscaler_plugins", "strategies", "adapters", "tests", "benchmarks", "recipes")
    # modules the tests, benchmarks and recipes import from each other by file name (harness, common, ...)
    local = {f[:-3] for folder in folders[3:] for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")}
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                tree = ast.parse(open(path).read())
                modules = _project_module_aliases(tree)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                            and node.value.id in modules and node.attr.startswith("_") \
                            and not node.attr.startswith("__"):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
                    if isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0] in (
                            "nnscaler_plugins", "strategies", "adapters", "tests") or node.module in local
                            or node.level):
                        for a in node.names:
                            if a.name.startswith("_") and not a.name.startswith("__"):
                                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {a.name} from "
                                           f"{'.' * node.level}{node.module or ''}")
    assert not bad, "private names imported from another file (make them public or move the code):\n" + "\n".join(bad)


def test_the_contract_sees_an_upward_import(tmp_path):
    """The checker itself: a lower part importing a higher one is reported."""
    (tmp_path / "lowering.py").write_text("def f():\n    from nnscaler_plugins.runtime.comm import Comm\n")
    (tmp_path / "gen.py").write_text("from nnscaler_plugins.codegen.generate import generate\n")
    mods = {"nnscaler_plugins.lower.lowering": str(tmp_path / "lowering.py"),
            "nnscaler_plugins.runtime.gen": str(tmp_path / "gen.py")}
    found = violations(mods)
    assert len(found) == 2 and "layer" in found[0] and "imports no codegen/" in found[1]
