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

import math
from collections import Counter
from typing import Optional, Sequence

from nnscaler_plugins.passes.parallelization import Parallelization
from nnscaler_plugins.plan.primitives import OpHandle

SEQUENCE_DIM = 1  # [batch, sequence, hidden]


def _shape(op: OpHandle) -> Optional[tuple[int, ...]]:
    out = op.node.outputs[0] if op.node.outputs else None
    if out is None:
        return None
    meta = op.builder.graph.values[out].meta
    return None if meta is None else tuple(meta.shape)


def residual_shape(ops: Sequence[OpHandle], whole: set[str]) -> Optional[tuple[int, ...]]:
    """The most common 3-D output shape among the ops tensor parallelism left whole."""
    shapes = Counter(s for op in ops if op.name in whole for s in [_shape(op)] if s is not None and len(s) == 3)
    return shapes.most_common(1)[0][0] if shapes else None


def apply_sp(par: Parallelization, axes: Sequence[str] = ("tp",)) -> int:
    """Turn the ops tensor parallelism runs whole on the residual stream (in each stage) into
    sequence splits along the same axes; returns how many. Run after `apply_tp`."""
    changed = 0
    for ops, rank in par.segments():
        if not ops:
            continue
        view = dict(par.view_of(ops[0]))
        names = [n for n in axes if n in view]
        n = math.prod(view[a] for a in names)
        if n == 1:
            continue
        whole = {op.name for op in ops if not any(par.choice(op, a) for a in names)}
        shape = residual_shape(ops, whole)
        if shape is None:
            continue
        for op in ops:
            mine = _shape(op)
            # the stream itself, and per-position statistics of it (an RMS norm's mean square)
            if op.name not in whole or mine is None or len(mine) != 3 or mine[:2] != shape[:2] \
                    or mine[2] not in (shape[2], 1):
                continue
            outs = op.signature.outputs
            if not outs or outs[0] is None:
                continue
            label = outs[0][SEQUENCE_DIM]
            if not op.splittable(label, n):
                continue
            par.split(op, names, label)
            changed += 1
    return changed
