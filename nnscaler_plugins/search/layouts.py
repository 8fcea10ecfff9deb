"""The layouts a placed op reads and writes, as the cost model needs them.

The reading of a placement is `nnscaler_plugins.lower.placement`'s, the one lowering uses: the cost model
needs the layouts to price the resharding between a producer and its consumers, and the size of the
device groups over which an input's gradient comes out partial.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from nnscaler_plugins.layout import Layout
from nnscaler_plugins.lower.placement import (
    layout_from_digits,
    partial_grad_size,
    tensor_blocks,
    tensor_digits,
)
from nnscaler_plugins.plan.plan import OpPlacement
from nnscaler_plugins.rules import Signature


@dataclass(frozen=True)
class Placement:
    """A plan's `OpPlacement` frozen, so that the search can key its caches by it: nested
    (label, num) splits, a replica factor, block factors as sorted (label, b) pairs, and the devices
    of its sub-ops (sub-op i on devices[i]). It means what `op_placement()` means."""

    splits: tuple[tuple[str, int], ...] = ()
    replicate: int = 1
    blocks: tuple[tuple[str, int], ...] = ()
    devices: tuple[int, ...] = (0,)

    def op_placement(self) -> OpPlacement:
        return OpPlacement(list(self.splits), self.replicate, list(self.devices), dict(self.blocks))

    @property
    def pieces(self) -> int:
        return math.prod(n for _, n in self.splits)

    def label_counts(self) -> dict[str, int]:
        return self.op_placement().label_counts()

    @classmethod
    def of(cls, p: OpPlacement) -> "Placement":
        """From a plan's `OpPlacement` (co-sharded pieces of one device seen as one piece)."""
        p = p.unit_view()
        return cls(tuple((str(l), int(n)) for l, n in p.splits), int(p.replicate),
                   tuple(sorted((str(l), int(b)) for l, b in p.blocks.items())),
                   tuple(int(d) if d is not None else 0 for d in p.devices))


def tensor_layout(shape: tuple[int, ...], sig: Signature, op_p: OpPlacement, labels: Optional[tuple[str, ...]],
                  is_output: bool, index: int) -> tuple[Optional[Layout], int]:
    """(layout on `op_p.devices`, or None where the split does not fit the shape; size of the groups
    over which the gradient is partial)."""
    digits = tensor_digits(sig, op_p, labels, is_output, index)
    partition = partial_grad_size(op_p, digits)
    try:
        lay = layout_from_digits(shape, op_p, digits, tensor_blocks(sig, op_p, labels, is_output, index, len(shape)))
    except ValueError:
        return None, partition
    return lay, partition


def op_layouts(shapes_in: tuple, shapes_out: tuple, sig: Signature, p: Placement,
               labels_in: tuple, labels_out: tuple) -> tuple[tuple, tuple, tuple]:
    """Per input and output: layout on `p.devices`; per input: partial-grad group size."""
    op_p = p.op_placement()
    ins, grads = [], []
    for i, (shape, labels) in enumerate(zip(shapes_in, labels_in)):
        lay, part = tensor_layout(shape, sig, op_p, labels, False, i)
        ins.append(lay)
        grads.append(part)
    outs = []
    for j, (shape, labels) in enumerate(zip(shapes_out, labels_out)):
        lay, _ = tensor_layout(shape, sig, op_p, labels, True, j)
        outs.append(lay)
    return tuple(ins), tuple(outs), tuple(grads)
