"""The rule table: one place that maps an aten overload to its dimension rule.

Built-in rules live in the sibling modules (one family of ops each) and register with `@rule`.
Plugins add or override rules through the `nnscaler_register_op_rules` hook; their rules win.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any, Callable, Optional

from nnscaler_plugins.capture.graph import Graph, OpNode, TensorMeta
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plugins import get_plugin_manager, plugins_generation
from nnscaler_plugins.rules.registry import (  # noqa: F401 - rule and op_key are part of this module's API
    BUILTIN,
    RuleFn,
    functional_key,
    op_key,
    rule,
)
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature, replicate_only


class ReplicateOnlyWarning(UserWarning):
    """Ops without a dimension rule: they run whole (replicated) on every device that needs them."""


def _load_builtins() -> None:
    # Importing the rule modules fills BUILTIN through @rule.
    from nnscaler_plugins.rules import (  # noqa: F401
        attention,
        complex_numbers,
        elementwise,
        embedding,
        experts,
        experts_op,
        flex_attention,
        factories,
        losses,
        matmul,
        norms,
        pooling,
        reductions,
        shape_ops,
        variable_length_attention,
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


_refreshes = [0]  # how many times `refresh` ran: the graphs' signature memos are per table


def refresh() -> None:
    """Forget cached rules. Registering a plugin through `nnscaler_plugins.plugins.register` is seen
    without it; this is for rules changed in place."""
    _table_for.cache_clear()
    _refreshes[0] += 1


def _rule_for(key: str) -> Optional[RuleFn]:
    """The op's own rule, else (for an in-place op) the rule of the functional op it computes."""
    table = _table()
    fn = table.get(key)
    if fn is None and functional_key(key) is not None:
        fn = table.get(functional_key(key))
    return fn


def has_rule(target: Any) -> bool:
    return _rule_for(op_key(target)) is not None


def signature_of(call: OpCall, where: str = "") -> Signature:
    """The signature for a call; replicate-only when no rule exists or the rule declines.

    `where` says where the op is in the model (its name, module path and source line) for the
    warning given when the rule itself fails."""
    fn = _rule_for(op_key(call.target))
    if fn is None:
        from nnscaler_plugins.rules.user_functions import function_rule
        fn = function_rule
    try:
        sig = fn(call)
    except Exception as e:  # noqa: BLE001 - a rule that cannot read this call: running the op whole is exact
        warnings.warn(f"the dimension rule of {op_key(call.target)}{f' at {where}' if where else ''} failed on inputs "
                      f"{[tuple(m.shape) for m in call.inputs]} ({type(e).__name__}: {e}); the op runs whole "
                      "(replicated) where it is. Fix or override the rule through nnscaler_register_op_rules",
                      ReplicateOnlyWarning, stacklevel=2)
        sig = None
    if sig is None:
        return replicate_only(call)
    if sig.localize is not None:
        sig = dataclasses.replace(sig, localize=_refusing(sig.localize, op_key(call.target), where))
    return sig


def _refusing(localize: Callable[[LocalCall], Localized], key: str, where: str) -> Callable[[LocalCall], Localized]:
    """`localize` with its failures turned into a PlanError naming the op and where it is: a rule
    that cannot say what a piece runs refuses the plan before anything is launched."""

    @functools.wraps(localize)
    def checked(lc: LocalCall) -> Localized:
        try:
            return localize(lc)
        except PlanError:
            raise
        except Exception as e:  # noqa: BLE001 - a rule's failure, named
            splits = ", ".join(f"{l} into {n}" for l, n in lc.splits.items())
            raise PlanError(f"the dimension rule of {key}{f' at {where}' if where else ''} cannot say what a piece "
                            f"split {splits} runs ({type(e).__name__}: {e}); plan this op whole, or fix or override "
                            "its rule through nnscaler_register_op_rules") from e

    return checked


def op_call(graph: Graph, op: OpNode) -> OpCall:
    metas = {n: graph.meta(n) for n in op.inputs}
    outs: list[Optional[TensorMeta]] = [graph.values[o].meta if o is not None else None for o in op.outputs]
    return OpCall.of(op, metas, outs)


def signature_for(graph: Graph, op: OpNode) -> Signature:
    """The signature of `op` in `graph`, computed once per graph and rule table.

    The plan builder, the validation, the cost model and the lowering each ask for every op of a
    graph (three times 7,751 rule calls for a 126-layer Llama); a graph is plain data made once per
    capture, so the answer is kept beside it (for as long as the graph lives), keyed by the op object,
    and asked again when the rule table changes (a plugin registered or unregistered, `refresh()`)."""
    table = (plugins_generation(), _refreshes[0])
    memo = _graph_memo(graph)
    known = memo[1].get(op.name)
    if known is not None and known[0] is op and known[1] == table:
        return known[2]
    call = op_call(graph, op)
    sig = replicate_only(call) if _mutation_read_elsewhere(graph, op) else signature_of(call, op.where())
    memo[1][op.name] = (op, table, sig)
    return sig


# graph id -> [a weak reference to the graph, {op name: (op, rule table, signature)}, its reads or None];
# kept beside the graph rather than on it, so a graph sent to another process carries no rule functions
_MEMOS: dict[int, list] = {}


def _graph_memo(graph: Graph) -> list:
    memo = _MEMOS.get(id(graph))
    if memo is None or memo[0]() is not graph:
        memo = _MEMOS[id(graph)] = [weakref.ref(graph), {}, None]
        weakref.finalize(graph, _MEMOS.pop, id(graph), None)
    return memo


def _mutation_read_elsewhere(graph: Graph, op: OpNode) -> bool:
    """Whether an in-place op's mutated tensor is also read without going through the op's output.

    The pieces of a split in-place op each mutate their own chunk. That is what the functional op
    computes as long as the result is only read through the op's output; a later op reading the
    mutated tensor by its old name (a statement `x.add_(y)` without assignment), a model output, or
    a parameter, buffer or input being mutated would see chunks instead of the whole mutated tensor,
    so such an op runs whole, exactly as eager.
    """
    key = op_key(op.target)
    if key in _table() or functional_key(key) is None or not op.inputs:
        return False
    target = op.inputs[0]
    if graph.values[target].kind != "op":
        return True
    if target in graph.outputs:
        return True
    position, last_read = _reads(graph)
    at = position.get(op.name)
    return at is not None and last_read.get(target, -1) > at  # an op after this one reads it


def _reads(graph: Graph) -> tuple[dict[str, int], dict[str, int]]:
    """Each op's position in the graph and each value's last reader's position, made once per graph
    (asked for every in-place op: a scan of the ops after each one grew as ops squared)."""
    memo = _graph_memo(graph)
    if memo[2] is None:
        position: dict[str, int] = {}
        last_read: dict[str, int] = {}
        for i, other in enumerate(graph.ops):
            position[other.name] = i
            for v in other.inputs:
                last_read[v] = i
        memo[2] = (position, last_read)
    return memo[2]


def unruled_ops(graph: Graph) -> list[OpNode]:
    """Ops with no rule (a custom Function whose code proves it elementwise has one)."""
    from nnscaler_plugins.rules.user_functions import function_rule
    return [op for op in graph.ops if _rule_for(op_key(op.target)) is None and any(o for o in op.outputs)
            and function_rule(op_call(graph, op)) is None]


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
