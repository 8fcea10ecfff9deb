"""The rule table: one place that maps an aten overload to its dimension rule.

Built-in rules live in the sibling modules (one family of ops each) and register with `@rule`.
Plugins add or override rules through the `nnscaler_register_op_rules` hook; their rules win.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

from nnscaler_plugins.capture.graph import Graph, OpNode, TensorMeta
from nnscaler_plugins.plugins import get_plugin_manager, plugins_generation
from nnscaler_plugins.rules.registry import BUILTIN, RuleFn, op_key, rule  # noqa: F401 - rule and op_key are part of this module's API
from nnscaler_plugins.rules.signature import OpCall, Signature, replicate_only


class ReplicateOnlyWarning(UserWarning):
    """Ops without a dimension rule: they run whole (replicated) on every device that needs them."""


def _load_builtins() -> None:
    # Importing the rule modules fills BUILTIN through @rule.
    from nnscaler_plugins.rules import (  # noqa: F401
        attention,
        elementwise,
        embedding,
        factories,
        losses,
        matmul,
        norms,
        reductions,
        shape_ops,
    )


@functools.lru_cache(maxsize=4)
def _table_for(generation: int) -> dict[str, RuleFn]:
    _load_builtins()
    table = dict(BUILTIN)
    for extra in get_plugin_manager().hook.nnscaler_register_op_rules():
        for k, fn in (extra or {}).items():
            table[op_key(k)] = fn
    return table


def _table() -> dict[str, RuleFn]:
    """Built-in rules, then plugins' (theirs win); read again whenever a plugin was registered."""
    return _table_for(plugins_generation())


def refresh() -> None:
    """Forget cached rules. Registering a plugin through `nnscaler_plugins.plugins.register` is seen
    without it; this is for rules changed in place."""
    _table_for.cache_clear()


def has_rule(target: Any) -> bool:
    return op_key(target) in _table()


def signature_of(call: OpCall) -> Signature:
    """The signature for a call; replicate-only when no rule exists or the rule declines."""
    fn = _table().get(op_key(call.target))
    try:
        sig = fn(call) if fn is not None else None
    except Exception as e:  # noqa: BLE001 - a rule that cannot read this call: running the op whole is exact
        warnings.warn(f"the dimension rule of {op_key(call.target)} failed on inputs "
                      f"{[tuple(m.shape) for m in call.inputs]} ({type(e).__name__}: {e}); the op runs whole "
                      "(replicated) where it is. Fix or override the rule through nnscaler_register_op_rules",
                      ReplicateOnlyWarning, stacklevel=2)
        sig = None
    return sig if sig is not None else replicate_only(call)


def op_call(graph: Graph, op: OpNode) -> OpCall:
    metas = {n: graph.meta(n) for n in op.inputs}
    outs: list[Optional[TensorMeta]] = [graph.values[o].meta if o is not None else None for o in op.outputs]
    return OpCall.of(op, metas, outs)


def signature_for(graph: Graph, op: OpNode) -> Signature:
    return signature_of(op_call(graph, op))


def unruled_ops(graph: Graph) -> list[OpNode]:
    table = _table()
    return [op for op in graph.ops if op_key(op.target) not in table and any(o for o in op.outputs)]


def warn_replicate_only(graph: Graph) -> None:
    """One warning listing every op with no rule, with its source line."""
    missing = unruled_ops(graph)
    if not missing:
        return
    lines = "\n".join(f"  {op.where()}" for op in missing)
    warnings.warn(
        f"{len(missing)} op(s) in {graph.model_class} have no dimension rule and will only be replicated:\n"
        f"{lines}\nAdd a rule through the nnscaler_register_op_rules hook to let plans split them.",
        ReplicateOnlyWarning, stacklevel=3)
