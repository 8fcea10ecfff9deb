"""Ops whose outputs nothing reads, removed from an exported program before it becomes a Graph.

torch.export keeps export's own shape and dtype assertions (`_assert_tensor_metadata` and kin) in
the graph, and an assertion counts as a reader: a chain that only an assertion reads stays alive.
Hugging Face models leave such chains behind once their causal mask is folded into `is_causal`
(causal_mask.py): aranges, index ops and comparisons that every rank would compute each step for
nothing. The assertions have no effect in generated code (tracing.py drops them), so they go
first, then every op nothing reads, except ops with side effects and ops that draw random numbers
(removing one would shift the random stream every later random op reads).
"""
from __future__ import annotations

import torch
import torch.fx

# export's own assertions: no runtime effect in generated code
ASSERTIONS = frozenset({
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
})


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _kept(node: torch.fx.Node) -> bool:
    return node.is_impure() or (node.op == "call_function" and _draws_random_numbers(node))


def drop_dead_code(ep: "torch.export.ExportedProgram") -> int:
    """Remove `ep`'s assertions and then the ops nothing reads, in place; returns how many ops went."""
    graph = ep.graph
    before = len(graph.nodes)
    for node in list(graph.nodes):
        if node.op == "call_function" and str(node.target) in ASSERTIONS and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=_kept)
    removed = before - len(graph.nodes)
    if removed:
        ep.graph_module.recompile()
    return removed
