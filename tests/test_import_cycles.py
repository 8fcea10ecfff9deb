"""No import cycles inside the core, the strategies or the adapters, counting imports made inside
functions (a lazy import still ties two modules together). Imports under `if TYPE_CHECKING:` are
annotations only and do not count; importing a package's `__init__` implicitly (as every
submodule import does) does not count either, only imports that name a module do.
"""
from __future__ import annotations

from import_graph import cycles, edges, modules


def test_no_import_cycles():
    graph = edges(modules())
    found = cycles(graph)
    detail = "\n".join(f"{c}: " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in found)
    assert not found, "import cycles:\n" + detail


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
