"""Which label of each op carries the batch dim, and which the sequence dim.

The search seeds data parallelism inside a device group (split every op along its batch label) and
sequence parallelism (split the ops between matmuls along the sequence), and constraints speak of
"the tensor-parallel degree", which is the splitting that is not along the batch. All three need to
know, per op, which of its labels is the batch and which the sequence. That follows from the graph
inputs (dim 0 of every batched input is the batch; dim 1 of a 2-D integer input, token ids, is the
sequence) carried through the ops' dimension rules: a label shares the tag of the input dims it
labels, and gives it to the output dims it labels.
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.rules import Signature

BATCH, SEQUENCE = "batch", "sequence"


def batch_size(graph: Graph) -> Optional[int]:
    for spec in graph.inputs:
        meta = graph.values[spec.name].meta
        if meta is not None and meta.ndim > 0:
            return int(meta.shape[0])
    return None


def tag_labels(graph: Graph, signatures: dict[str, Signature]) -> dict[str, dict[str, str]]:
    """Per op: {label: "batch" | "sequence"} for the labels carrying those dims."""
    b = batch_size(graph)
    tags: dict[str, list[Optional[str]]] = {}
    for spec in graph.inputs:
        meta = graph.values[spec.name].meta
        if meta is None or meta.ndim == 0:
            continue
        t: list[Optional[str]] = [None] * meta.ndim
        if meta.shape[0] == b:
            t[0] = BATCH
        if meta.ndim == 2 and not meta.dtype.is_floating_point and meta.shape[1] > 1:
            t[1] = SEQUENCE
        tags[spec.name] = t
    out: dict[str, dict[str, str]] = {}
    for op in graph.ops:
        sig = signatures[op.name]
        labels: dict[str, str] = {}
        for i, v in enumerate(op.inputs):
            t = tags.get(v)
            lab = sig.inputs[i] if i < len(sig.inputs) else None
            if t is None or lab is None or len(lab) != len(t):
                continue
            for d, l in enumerate(lab):
                if t[d] is not None and not sig.is_frozen(l):
                    labels.setdefault(l, t[d])
        out[op.name] = labels
        for j, v in enumerate(op.outputs):
            if v is None or graph.values[v].meta is None:
                continue
            lab = sig.outputs[j] if j < len(sig.outputs) else None
            if lab is None:
                continue
            tags[v] = [labels.get(l) for l in lab]
    return out
