"""Megatron's sequence parallelism as a choice of splits, not a separate code path.

Between a row-parallel matmul and the next column-parallel one, tensor parallelism runs the
layer norms, dropouts and residual adds whole on every device. Sequence parallelism splits them
along the sequence dim instead: each device keeps 1/tp of those activations. Nothing else has to
be written for it: lowering compares layouts, so the partial sum leaving a row-parallel matmul
meets a sequence-split consumer through a reduce-scatter, and a column-parallel matmul reading a
sequence-split input gets an all-gather, which is exactly Megatron's communication (the same
bytes as the all-reduce it replaces, split in two).

The residual stream is found by shape, not by module names: the most common output shape among
the ops tensor parallelism left whole ([batch, sequence, hidden] in a transformer); ops making
that shape, or per-position statistics of it ([batch, sequence, 1]), are split.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from nnscaler_plugins.plan.primitives import OpHandle

from .propagation import Choice, TensorParallelPropagation

SEQUENCE_DIM = 1  # [batch, sequence, hidden]


def _shape(op: OpHandle) -> Optional[tuple[int, ...]]:
    out = op.node.outputs[0] if op.node.outputs else None
    if out is None:
        return None
    meta = op.builder.graph.values[out].meta
    return None if meta is None else tuple(meta.shape)


def residual_shape(prop: TensorParallelPropagation) -> Optional[tuple[int, ...]]:
    shapes = Counter(s for op in prop.ops if prop.choices[op.name].label is None
                     for s in [_shape(op)] if s is not None and len(s) == 3)
    return shapes.most_common(1)[0][0] if shapes else None


def apply_sequence_parallel(prop: TensorParallelPropagation) -> int:
    """Turn the whole-running ops on the residual stream into sequence splits; returns how many."""
    if not prop.choices:
        prop.run()
    shape = residual_shape(prop)
    if shape is None or prop.n == 1:
        return 0
    changed = 0
    for op in prop.ops:
        mine = _shape(op)
        # the stream itself, and per-position statistics of it (an RMS norm's mean square)
        if prop.choices[op.name].label is not None or mine is None or len(mine) != 3 \
                or mine[:2] != shape[:2] or mine[2] not in (shape[2], 1):
            continue
        outs = op.signature.outputs
        if not outs or outs[0] is None:
            continue
        label = outs[0][SEQUENCE_DIM]
        if not op.splittable(label, prop.n):
            continue
        prop.choices[op.name] = Choice(label)
        changed += 1
    return changed
