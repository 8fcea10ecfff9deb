"""Activation recompute as a plan choice: which ops run again in backward instead of keeping
their activations.

    recompute="full"        every layer of the layer stack, as one group each (Megatron's full recompute)
    recompute="selective"   per layer, the attention core: the ops of attention modules that read
                            no parameter (scores, softmax, dropout, the product with values), which
                            hold the activations that grow with the sequence (Korthikanti et al.)
    recompute="MyBlock"     every module of that class name (or module path part), one group per module
    recompute=["blocks.0.attn", ...]  those module paths, one group each
"""
from __future__ import annotations

from typing import Any, Sequence, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.layers import layer_groups
from nnscaler_plugins.plan.primitives import PlanBuilder

_ATTENTION = ("attn", "attention")
_PRODUCTS = ("mm", "matmul", "einsum", "scaled_dot_product", "attention")


def apply_recompute(builder: PlanBuilder, recompute: Union[None, str, Sequence[str]]) -> int:
    """Mark the recompute groups on the builder and record the mode in its knobs ("full",
    "selective", or "custom" for module names); returns how many groups were made."""
    if recompute in (None, "none", False):
        return 0
    graph = builder.graph
    handles = {op.name: op for op in builder.ops}
    groups: list[list[Any]] = []
    if recompute == "full":
        groups = [[handles[op.name] for op in layer] for layer in layer_groups(graph).layers]
    elif recompute == "selective":
        for layer in layer_groups(graph).layers:
            core = [handles[op.name] for op in _attention_core(graph, layer)]
            if core:
                groups.append(core)
    else:
        wanted = [recompute] if isinstance(recompute, str) else list(recompute)
        by_module: dict[str, list[Any]] = {}
        for op in builder.ops:
            path, cls = op.node.module_path, op.node.module_type
            hit = next((w for w in wanted if w == cls or w == path or path.startswith(w + ".")), None)
            if hit is not None:
                key = path if hit == cls else hit
                by_module.setdefault(key, []).append(op)
        groups = list(by_module.values())
    if not groups:
        raise PlanError(f"recompute={recompute!r} matches no ops of {graph.model_class}; use 'full', 'selective', "
                        "a module class name or module paths")
    for ops in groups:
        builder.recompute(ops)
    builder.set_knobs(recompute=recompute if recompute in ("full", "selective") else "custom")
    return len(groups)


def _is_attention_core(graph, op) -> bool:
    path = op.module_path.lower()
    if not any(a in path.split(".")[-1] or a in path for a in _ATTENTION):
        return False
    return not any(graph.values[v].kind == "param" for v in op.inputs) and op.grad_enabled


def _attention_core(graph, layer) -> list:
    """The layer's attention-core ops, without those after the output projection (a view of its
    result, its dropout): recomputing them would keep the projection's output (a whole partial sum
    under tensor parallelism) for backward, where Megatron keeps only the dropout's mask."""
    core_out: set = set()
    after: set = set()  # values made from the core's result by a parameter-reading op, and their uses
    products = False  # whether a product of activations (scores, probabilities x values) was seen
    out = []
    for op in layer:
        reads_param = any(graph.values[v].kind == "param" for v in op.inputs)
        if any(v in after for v in op.inputs) or (products and reads_param and any(v in core_out for v in op.inputs)):
            after.update(v for v in op.outputs if v is not None)
        elif _is_attention_core(graph, op):
            out.append(op)
            core_out.update(v for v in op.outputs if v is not None)
            products = products or any(k in op.short_name for k in _PRODUCTS)
    return out
