"""The layouts a placed op reads and writes, as the cost model needs them.

This is the reading of a plan that lowering makes (an op's split digits become replicas, partial
sums or split dims of each tensor), restated here because the search must not depend on lowering:
it only needs the layouts, to price the resharding between a producer and its consumers, and the
device groups over which an input's gradient comes out partial.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..layout import Layout
from ..rules import Signature


@dataclass(frozen=True)
class Placement:
    """One op's split: nested (label, num) splits, a replica factor, block factors, and the devices
    of its sub-ops (sub-op i on devices[i], numbered as `OpPlacement` numbers them)."""

    splits: tuple[tuple[str, int], ...] = ()
    replicate: int = 1
    blocks: tuple[tuple[str, int], ...] = ()
    devices: tuple[int, ...] = (0,)

    @property
    def pieces(self) -> int:
        return math.prod(n for _, n in self.splits)

    @property
    def num_subops(self) -> int:
        return self.replicate * self.pieces

    def label_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for l, n in self.splits:
            out[l] = out.get(l, 1) * n
        return out

    def describe(self) -> str:
        if not self.splits:
            return "replicated" if self.replicate > 1 else "whole"
        text = " x ".join(f"{l}/{n}" for l, n in self.splits)
        return text + (f" (x{self.replicate})" if self.replicate > 1 else "")

    @classmethod
    def of(cls, p) -> "Placement":
        """From a plan's `OpPlacement` (co-sharded pieces of one device seen as one piece)."""
        view = getattr(p, "unit_view", None)
        if view is not None:
            p = view()
        return cls(tuple((str(l), int(n)) for l, n in p.splits), int(p.replicate),
                   tuple(sorted((str(l), int(b)) for l, b in p.blocks.items())),
                   tuple(int(d) if d is not None else 0 for d in p.devices))


def _kinds(sig: Signature, splits, labels: Optional[tuple[str, ...]], is_output: bool, index: int) -> list[tuple]:
    kinds: list[tuple] = [("R", "compute")]
    for label, _ in splits:
        if labels is not None and label in labels:
            kinds.append(("D", labels.index(label)))
        elif is_output and label in sig.reduce:
            kinds.append(("V", None))
        elif not is_output and index in sig.partial_inputs.get(label, frozenset()):
            kinds.append(("V", None))
        else:
            kinds.append(("R", "partition"))
    return kinds


def _digits(index: int, radices: list[int]) -> list[int]:
    out = []
    for r in reversed(radices):
        out.append(index % r)
        index //= r
    return out[::-1]


def tensor_layout(shape: tuple[int, ...], sig: Signature, p: Placement, labels: Optional[tuple[str, ...]],
                  is_output: bool, index: int, group: tuple[int, ...]) -> tuple[Optional[Layout], int]:
    """(layout on `group`'s positions, size of the groups over which the gradient is partial)."""
    kinds = _kinds(sig, p.splits, labels, is_output, index)
    radices = [p.replicate] + [n for _, n in p.splits]
    ndim = len(shape)
    R = math.prod(r for r, k in zip(radices, kinds) if k[0] == "R")
    V = math.prod(r for r, k in zip(radices, kinds) if k[0] == "V")
    partition = math.prod(r for r, k in zip(radices, kinds) if k == ("R", "partition"))
    splits = [1] * ndim
    for r, k in zip(radices, kinds):
        if k[0] == "D":
            splits[k[1]] *= r
    blocks_map = dict(p.blocks)
    rule_blocks = getattr(sig, "blocks", None) or {}
    blocks = [1] * ndim
    split_labels = {l for l, _ in p.splits}
    for d, label in enumerate(labels or ()):
        if label in split_labels:
            b = rule_blocks.get((label, index), blocks_map.get(label, 1)) if not is_output else blocks_map.get(label, 1)
            blocks[d] = b
    positions = [0] * p.num_subops
    for idx in range(p.num_subops):
        digits = _digits(idx, radices)
        r = v = 0
        dpos = [0] * ndim
        for dig, rad, k in zip(digits, radices, kinds):
            if k[0] == "R":
                r = r * rad + dig
            elif k[0] == "V":
                v = v * rad + dig
            else:
                dpos[k[1]] = dpos[k[1]] * rad + dig
        pos = r * V + v
        for dd in range(ndim):
            pos = pos * splits[dd] + dpos[dd]
        positions[pos] = group[idx]
    try:
        lay = Layout(shape=tuple(shape), group=tuple(positions), replicas=R, partial=V, splits=tuple(splits),
                     blocks=tuple(blocks))
    except ValueError:
        return None, partition
    return lay, partition


def op_layouts(shapes_in: tuple, shapes_out: tuple, sig: Signature, p: Placement, group: tuple[int, ...],
               labels_in: tuple, labels_out: tuple) -> tuple[tuple, tuple, tuple]:
    """Per input and output: layout on `group` (device ids in sub-op order); per input: partial-grad group size."""
    ins, grads = [], []
    for i, (shape, labels) in enumerate(zip(shapes_in, labels_in)):
        lay, part = tensor_layout(shape, sig, p, labels, False, i, group)
        ins.append(lay)
        grads.append(part)
    outs = []
    for j, (shape, labels) in enumerate(zip(shapes_out, labels_out)):
        lay, _ = tensor_layout(shape, sig, p, labels, True, j, group)
        outs.append(lay)
    return tuple(ins), tuple(outs), tuple(grads)
