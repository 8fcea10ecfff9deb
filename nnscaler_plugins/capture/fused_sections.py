"""Fused projections cut into sections of unequal size become one projection per section.

Why: a fused QKV projection whose output is cut into [q: heads*d | k: kv_heads*d | v: kv_heads*d]
(multi-query or grouped heads: Falcon, GPT-BigCode, Phi-3), or any projection whose output is cut
into unequal pieces (DeepSeek's [kv latent | rope key]), cannot be split as one tensor: tensor
parallelism wants q split by heads, k and v split by their own heads or, when there are fewer of
them than devices, whole on every device as Megatron keeps them. One RVD layout cannot describe a
tensor that is partly split and partly whole, nor one split in unequal sections. Seen as one matmul
per section over a slice of the weight (`linear(x, W[a:b], bias[a:b])`), each section is an
ordinary matmul with an ordinary layout, and each is split or kept whole on its own.

The parameter stays one parameter (the section ops read slices of it), so state-dict names,
checkpoints and their resharding, ZeRO, meta initialization and optimizer state see the model as
it is; a slice's gradient lands in its rows of the parameter's gradient. Each section computes
the same dot products as the fused matmul. Sections of equal size cut by one split/chunk op are
left alone: the blocked split of `rules/shape_ops.split` already splits them.

What is recognized, by structure: a `linear` with a parameter weight (or a `matmul` with the
transpose of one) whose output reaches, through views that keep the cut dim (reshape, view,
unsqueeze), only ops that cut that dim into contiguous ranges: `slice` with step 1, `split`,
`split_with_sizes` (Falcon's `t[..., [-2], :]` is one: `constant_index.py` makes it a slice first).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode, Ref, TensorMeta, Value

_LINEAR = "aten.linear.default"
_MATMUL = "aten.matmul.default"
_TRANSPOSES = ("aten.numpy_T.default", "aten.t.default")
_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")


@dataclasses.dataclass
class _Projection:
    op: OpNode
    weight: str  # the value the section ops slice: the parameter, or its transpose for matmul
    weight_dim: int  # the dim of `weight` holding the output features
    bias: Optional[str]
    bias_op: Optional[OpNode] = None  # the `add` of the bias when the matmul does not take it



@dataclasses.dataclass
class _Section:
    value: str  # the extractor's output, which the section now produces
    start: int
    stop: int
    source: OpNode  # the extractor (for the module path and source line of the view)


def split_fused_sections(graph: Graph) -> Graph:
    """The graph with every fused projection cut into unequal sections made one matmul per section."""
    consumers: dict[str, list[OpNode]] = {}
    for op in graph.ops:
        for v in dict.fromkeys(op.inputs):
            consumers.setdefault(v, []).append(op)
    outputs = {o for o in graph.outputs if o is not None}
    plans = []
    for op in graph.ops:
        proj = _projection(graph, op, consumers)
        if proj is None:
            continue
        found = _sections(graph, proj, consumers, outputs)
        if found is not None:
            plans.append((proj, *found))
    if not plans:
        return graph
    values = dict(graph.values)
    replaced: dict[str, list[OpNode]] = {}
    removed: set[str] = set()
    for proj, sections, dead in plans:
        replaced[proj.op.name] = _section_ops(graph, proj, sections, values)
        removed |= {op.name for op in dead}
        for op in dead:
            for o in op.outputs:
                if o is not None and o not in {s.value for s in sections}:
                    values.pop(o, None)
    ops: list[OpNode] = []
    for op in graph.ops:
        if op.name in replaced:
            ops.extend(replaced[op.name])
        elif op.name not in removed:
            ops.append(op)
    used = {v for op in ops for v in op.inputs} | {o for op in ops for o in op.outputs if o is not None}
    values = {k: v for k, v in values.items() if v.kind != "op" or k in used}
    return dataclasses.replace(graph, ops=ops, values=values)


def _projection(graph: Graph, op: OpNode, consumers: dict[str, list[OpNode]]) -> Optional[_Projection]:
    if op.op_name == _LINEAR and len(op.inputs) >= 2 and graph.values[op.inputs[1]].kind == "param":
        w = graph.values[op.inputs[1]]
        if w.meta is None or w.meta.ndim != 2 or op.args[1] != Ref(op.inputs[1]):
            return None
        bias = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
        bias = bias.name if isinstance(bias, Ref) else None
        if bias is not None and graph.values[bias].kind != "param":
            return None
        return _Projection(op, op.inputs[1], 0, bias)
    if op.op_name == _MATMUL and len(op.inputs) == 2 and not op.kwargs:
        wt = graph.values[op.inputs[1]]
        producer = graph.op(wt.producer) if wt.kind == "op" and wt.producer else None
        if producer is None or producer.op_name not in _TRANSPOSES or len(consumers.get(wt.name, ())) != 1:
            return None
        w = graph.values[producer.inputs[0]]
        if w.kind != "param" or w.meta is None or w.meta.ndim != 2:
            return None
        return _Projection(op, wt.name, 1, None)
    return None


def _sections(graph: Graph, proj: _Projection, consumers: dict[str, list[OpNode]],
              outputs: set[str]) -> Optional[tuple[list[_Section], list[OpNode]]]:
    """The sections the projection's output is cut into and the ops that cut it, or None."""
    y = proj.op.outputs[0]
    if y is None or len(proj.op.outputs) != 1:
        return None
    meta = graph.meta(y)
    sections: list[_Section] = []
    dead: list[OpNode] = [proj.op]
    cutters: list[OpNode] = []
    frontier = [(y, meta.ndim - 1, 1)]  # (value, cut dim, elements of the fused dim per index of it)
    while frontier:
        value, dim, unit = frontier.pop()
        if value in outputs or not consumers.get(value):
            return None
        for c in consumers[value]:
            if c.inputs.count(value) != 1 or c.inputs[0] != value:
                return None
            shape = graph.meta(value).shape
            if value == y and proj.bias is None and _is_bias_add(graph, c, shape):
                proj.bias, proj.bias_op = c.inputs[1], c  # `x @ W.T + b` (Falcon's linear with a bias)
                dead.append(c)
                frontier.append((c.outputs[0], dim, unit))
                continue
            nxt = _through_view(graph, c, shape, dim, unit)
            if nxt is not None:
                dead.append(c)
                frontier.append((c.outputs[0], *nxt))
                continue
            cut = _cut(graph, c, shape, dim, unit)
            if cut is None:
                return None
            dead.append(c)
            cutters.append(c)
            sections.extend(cut)
    if len(sections) < 2:
        return None
    sizes = {s.stop - s.start for s in sections}
    if len(sizes) == 1 and len(cutters) == 1 and cutters[0].op_name in _SPLITS:
        return None  # equal sections of one split: the blocked split takes them
    ordered = sorted((s.start, s.stop) for s in sections)
    if any(a >= b for a, b in ordered) or any(b > a for (_, b), (a, _) in zip(ordered, ordered[1:])):
        return None  # empty or overlapping sections: views of one tensor, not pieces of it
    return sections, dead


def _is_bias_add(graph: Graph, op: OpNode, shape: tuple[int, ...]) -> bool:
    """`y + b` with `b` a parameter of one dim, as long as y's last dim."""
    if op.op_name != "aten.add.Tensor" or len(op.inputs) != 2 or len(op.args) != 2 or op.kwargs:
        return False
    b = graph.values[op.inputs[1]]
    return b.kind == "param" and b.meta is not None and tuple(b.meta.shape) == (shape[-1],)


def _through_view(graph: Graph, op: OpNode, shape: tuple[int, ...], dim: int,
                  unit: int) -> Optional[tuple[int, int]]:
    """(cut dim, unit) of a view's output that keeps the cut dim's prefix, or None."""
    if op.op_name == "aten.unsqueeze.default":
        out = graph.meta(op.outputs[0]).shape
        d = op.args[1] % len(out)
        return (dim + 1, unit) if d <= dim else (dim, unit)
    if op.op_name not in _VIEWS:
        return None
    out = tuple(graph.meta(op.outputs[0]).shape)
    if len(out) <= dim or out[:dim] != tuple(shape[:dim]) or math.prod(out[dim:]) != math.prod(shape[dim:]):
        return None
    while dim < len(out) - 1 and out[dim] == 1:  # a dim of one (one key/value group) holds nothing to cut
        dim += 1
    return dim, math.prod(out[dim + 1:])


def _cut(graph: Graph, op: OpNode, shape: tuple[int, ...], dim: int, unit: int) -> Optional[list[_Section]]:
    """The contiguous ranges of the fused dim an op cuts out (one per output), or None."""
    size = shape[dim]
    name = op.op_name
    if op.kwargs:
        return None  # arguments as written by torch.export are positional; anything else is not read here
    if name == "aten.slice.Tensor":
        args = list(op.args) + [None] * (5 - len(op.args))
        d, start, stop, step = (args[1] if args[1] is not None else 0), args[2], args[3], args[4]
        if d % len(shape) != dim or step not in (None, 1):
            return None
        start, stop, _ = slice(start, stop).indices(size)
        return [_Section(op.outputs[0], start * unit, stop * unit, op)]
    if name in _SPLITS:
        d = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)
        if d % len(shape) != dim:
            return None
        sizes = op.args[1]
        if isinstance(sizes, int):
            sizes = [min(sizes, size - k) for k in range(0, size, sizes)]
        out, at = [], 0
        for o, s in zip(op.outputs, sizes):
            if o is not None:
                out.append(_Section(o, at * unit, (at + s) * unit, op))
            at += s
        return out if len(sizes) == len(op.outputs) else None
    return None


def _section_ops(graph: Graph, proj: _Projection, sections: list[_Section], values: dict[str, Value]) -> list[OpNode]:
    """Per section: a slice of the weight (and bias), the matmul over it, a view to the cut's shape."""
    op = proj.op
    y = graph.meta(op.outputs[0])
    taken = set(values) | {o.name for o in graph.ops}
    out: list[OpNode] = []

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    def emit(base: str, target: Any, args: tuple, inputs: list[str], meta: TensorMeta, source: OpNode,
             output: Optional[str] = None) -> str:
        name = fresh(base)
        result = name if output is None else output
        out.append(dataclasses.replace(source, name=name, target=target, args=args, kwargs={}, inputs=inputs,
                                       outputs=[result], multi_output=False))
        values[result] = Value(result, "op", meta, producer=name)
        return result

    def sliced(base: str, value: str, dim: int, a: int, b: int) -> str:
        m = graph.meta(value)
        shape = list(m.shape)
        shape[dim] = b - a
        return emit(base, torch.ops.aten.slice.Tensor, (Ref(value), dim, a, b), [value],
                    TensorMeta(tuple(shape), m.dtype, m.requires_grad), op)

    for k, s in enumerate(sections):
        w = sliced(f"{op.name}_weight{k}", proj.weight, proj.weight_dim, s.start, s.stop)
        meta = TensorMeta(tuple(y.shape[:-1]) + (s.stop - s.start,), y.dtype, y.requires_grad)
        want = graph.meta(s.value)
        direct = tuple(want.shape) == meta.shape
        b = sliced(f"{op.name}_bias{k}", proj.bias, 0, s.start, s.stop) if proj.bias is not None else None
        chain: list[tuple[str, Any, tuple, list[str], OpNode]] = []
        if op.op_name == _LINEAR:
            args: tuple = (op.args[0], Ref(w)) + ((Ref(b),) if b else ())
            chain.append((f"{op.name}_section{k}", op.target, args, [op.inputs[0], w] + ([b] if b else []), op))
        else:
            chain.append((f"{op.name}_section{k}", op.target, (op.args[0], Ref(w)), [op.inputs[0], w], op))
            if b is not None:
                chain.append((f"{proj.bias_op.name}_section{k}", proj.bias_op.target, (None, Ref(b)), [None, b],
                              proj.bias_op))
        values.pop(s.value, None)
        part: Optional[str] = None
        for i, (base, target, args, inputs, source) in enumerate(chain):
            if part is not None:  # the add reads the matmul's section
                args, inputs = (Ref(part),) + args[1:], [part] + inputs[1:]
            last = i == len(chain) - 1 and direct
            part = emit(base, target, args, inputs, want if last else meta, source,
                        output=s.value if last else None)
        if direct:
            continue
        emit(f"{s.source.name}_view", torch.ops.aten.view.default, (Ref(part), list(want.shape)), [part], want,
             s.source, output=s.value)
    return out
