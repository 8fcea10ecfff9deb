"""Indexing by a constant run of consecutive positions is captured as the slice it is.

Why: `t[..., [-2], :]` (Falcon's key and value heads) exports as `aten.index.Tensor` with a lifted
constant index tensor. Indexing by data has no split (`rules/shape_ops.gather_like` keeps it whole),
so every dim of `t`, heads and groups included, had to arrive whole. A constant run `[a, a+1, ...]`
along one dim reads exactly `t.narrow(dim, a, len)`, a slice, whose other dims split freely. The
value the model computes is the same; only the op that computes it changes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Graph, Ref

_INDEX = "aten.index.Tensor"
_LIFT = "aten.lift_fresh_copy.default"


def slices_for_constant_index(graph: Graph) -> Graph:
    """The graph with every `index` by a constant consecutive run along one dim made a `slice`."""
    mutated = {op.inputs[0] for op in graph.ops if op.inputs and op.short_name.endswith("_")}
    ops, changed = [], False
    for op in graph.ops:
        run = _constant_run(graph, op)
        if run is None or op.outputs[0] in mutated:  # a slice is a view: an in-place op on it would write through
            ops.append(op)
            continue
        dim, start, stop = run
        ops.append(dataclasses.replace(op, target=torch.ops.aten.slice.Tensor, args=(op.args[0], dim, start, stop),
                                       kwargs={}, inputs=[op.inputs[0]]))
        changed = True
    if not changed:
        return graph
    read = {v for op in ops for v in op.inputs} | {o for o in graph.outputs if o is not None}
    ops = [op for op in ops if not (op.op_name == _LIFT and not any(o in read for o in op.outputs if o))]
    made = {o for op in ops for o in op.outputs if o is not None}
    values = {k: v for k, v in graph.values.items() if v.kind != "op" or k in made}
    return dataclasses.replace(graph, ops=ops, values=values)


def _constant_run(graph: Graph, op) -> Optional[tuple[int, int, int]]:
    """(dim, start, stop) when `op` indexes one dim by a constant run of consecutive positions."""
    if op.op_name != _INDEX or op.kwargs or len(op.args) != 2 or not op.inputs:
        return None
    indices = op.args[1]
    if not indices or any(i is not None for i in indices[:-1]):
        return None
    dim = len(indices) - 1
    size = graph.meta(op.inputs[0]).shape[dim]
    index = _constant(graph, indices[dim])
    if (index is None or index.device.type == "meta" or index.ndim != 1 or index.numel() == 0
            or index.dtype not in (torch.int64, torch.int32)):
        return None
    values = index.tolist()
    if any(not -size <= i < size for i in values):
        return None  # out of range: the index op's own error is the model's
    run = [i % size for i in values]
    if run != list(range(run[0], run[0] + len(run))):
        return None
    return dim, run[0], run[-1] + 1


def _constant(graph: Graph, ref: Any) -> Optional[torch.Tensor]:
    """The value of a lifted constant tensor (`lift_fresh_copy(c)`) an op reads, or None."""
    if not isinstance(ref, Ref):
        return None
    v = graph.values[ref.name]
    if v.kind == "constant":
        return graph.constants.get(v.fqn)
    if v.kind == "op" and v.producer:
        producer = graph.op(v.producer)
        if producer.op_name == _LIFT:
            return _constant(graph, producer.args[0])
    return None
