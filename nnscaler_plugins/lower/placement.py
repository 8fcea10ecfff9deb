"""What an op's placement means for each tensor it reads and writes.

An `OpPlacement` numbers an op's sub-ops by digits (replica, split_1, ..., split_k): the replica
digit counts copies of the whole op, split digit i counts pieces along the label of split i. For
one tensor of the op, read through the op's dimension rule, every digit means one of four things
(`DigitKind`):

    REPLICA    the op's replica digit: each copy of the op holds the tensor whole
    PARTITION  a split along a label the tensor does not carry: each piece holds the tensor whole,
               and an input's gradient comes out as partial sums across those pieces
    PARTIAL    the tensor is a partial sum across the pieces: an output of a split along a
               reduction, or an input the rule takes as partial sums along the label (a bias)
    SPLIT      the tensor is cut along the dim that carries the label

REPLICA and PARTITION digits are the tensor's replicas in its RVD layout (`layout.Layout`), PARTIAL
digits its value chunks and SPLIT digits its pieces per dim; `tensor_layout` turns a placement into
that layout on the sub-ops' devices. Lowering reads plans through this module and the search
prices candidate placements through it; the tensor-parallel strategy, which reasons about one split
at a time, asks `label_digit` what that split does to a tensor.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from nnscaler_plugins.layout import Layout
from nnscaler_plugins.plan.plan import OpPlacement
from nnscaler_plugins.rules import Signature

DeviceGroups = tuple[tuple[int, ...], ...]


class DigitKind(enum.Enum):
    REPLICA = "replica"
    PARTITION = "partition"
    PARTIAL = "partial"
    SPLIT = "split"

    @property
    def whole(self) -> bool:
        """The tensor is whole on every sub-op along this digit (a replica of the layout)."""
        return self is DigitKind.REPLICA or self is DigitKind.PARTITION


@dataclass(frozen=True)
class Digit:
    """What one sub-op digit means for one tensor; `dim` is the tensor dim a SPLIT digit cuts."""

    kind: DigitKind
    dim: Optional[int] = None


REPLICA = Digit(DigitKind.REPLICA)
PARTITION = Digit(DigitKind.PARTITION)
PARTIAL = Digit(DigitKind.PARTIAL)


def merged_host(sig: Signature, label: str, labels: Optional[Sequence[str]]) -> Optional[tuple[int, int]]:
    """(dim, blocks) when a tensor lacking `label` holds it inside a merged dim (`Signature.merged`)."""
    host = (getattr(sig, "merged", None) or {}).get(label)
    if host is None or labels is None or label in labels or host[0] not in labels:
        return None
    return labels.index(host[0]), int(host[1])


def label_digit(sig: Signature, label: str, labels: Optional[Sequence[str]], is_output: bool, index: int) -> Digit:
    """What splitting `label` does to input or output `index` of an op, whose dims carry `labels`."""
    if labels is not None and label in labels:
        return Digit(DigitKind.SPLIT, labels.index(label))
    host = merged_host(sig, label, labels)
    if host is not None:
        return Digit(DigitKind.SPLIT, host[0])
    if is_output and label in sig.reduce:
        return PARTIAL
    if not is_output and index in sig.partial_inputs.get(label, frozenset()):
        return PARTIAL
    return PARTITION


def tensor_digits(sig: Signature, p: OpPlacement, labels: Optional[Sequence[str]], is_output: bool,
                  index: int) -> tuple[Digit, ...]:
    """What each digit of `p`'s sub-op numbering means for one tensor: the replica digit, then one per split."""
    return (REPLICA,) + tuple(label_digit(sig, label, labels, is_output, index) for label, _ in p.splits)


def tensor_blocks(sig: Signature, p: OpPlacement, labels: Optional[Sequence[str]], is_output: bool, index: int,
                  ndim: int) -> tuple[int, ...]:
    """Block factor of each dim of one tensor: the rule's for an input where it fixes one, else the plan's."""
    split_labels = {label for label, _ in p.splits}
    rule_blocks = getattr(sig, "blocks", None) or {}
    out = [1] * ndim
    for d, label in enumerate(labels or ()):
        if d < ndim and label in split_labels:
            plan_block = p.blocks.get(label, 1)
            out[d] = plan_block if is_output else rule_blocks.get((label, index), plan_block)
    hosted: dict[int, str] = {}
    for label in split_labels:
        host = merged_host(sig, label, labels)
        if host is not None and host[0] < ndim:
            if labels[host[0]] in split_labels:
                raise ValueError(f"dim {host[0]} cannot be split along both {labels[host[0]]!r} and the "
                                 f"{label!r} merged into it")
            if host[0] in hosted:  # one block factor cannot hold two labels' nesting in either order
                raise ValueError(f"dim {host[0]} cannot be split along both {hosted[host[0]]!r} and {label!r}, "
                                 "both merged into it")
            hosted[host[0]] = label
            plan_block = p.blocks.get(label, 1)
            if plan_block < 0 and plan_block % 2 and host[1] > 1:
                # a mirrored split alternates across the merged dim's blocks; each of the host's
                # rows must start on an even block for the rows to mirror alike
                raise ValueError(f"{label!r} is merged into dim {host[0]}; its mirrored split of {-plan_block} "
                                 f"blocks (odd) cannot repeat in the dim's {host[1]} rows")
            out[host[0]] = host[1] * plan_block  # each of the merged dim's blocks holds the label's blocks
    return tuple(out)


def layout_from_digits(shape: Sequence[int], p: OpPlacement, digits: Sequence[Digit],
                       blocks: Sequence[int]) -> Layout:
    """The RVD layout of a tensor whose digits mean `digits`, on `p.devices` (sub-op i on devices[i]).

    Raises ValueError when the split does not fit the shape.
    """
    radices = [p.replicate] + [n for _, n in p.splits]
    ndim = len(shape)
    replicas = math.prod(r for r, dg in zip(radices, digits) if dg.kind.whole)
    partial = math.prod(r for r, dg in zip(radices, digits) if dg.kind is DigitKind.PARTIAL)
    splits = [1] * ndim
    for r, dg in zip(radices, digits):
        if dg.kind is DigitKind.SPLIT:
            splits[dg.dim] *= r
    group: list[Optional[int]] = [None] * p.num_subops
    for idx in range(p.num_subops):
        r = v = 0
        dpos = [0] * ndim
        for digit, radix, dg in zip(p.digits(idx), radices, digits):
            if dg.kind.whole:
                r = r * radix + digit
            elif dg.kind is DigitKind.PARTIAL:
                v = v * radix + digit
            else:
                dpos[dg.dim] = dpos[dg.dim] * radix + digit
        pos = r * partial + v
        for d in range(ndim):
            pos = pos * splits[d] + dpos[d]
        group[pos] = p.devices[idx]
    return Layout(shape=tuple(shape), group=tuple(group), replicas=replicas, partial=partial, splits=tuple(splits),
                  blocks=tuple(blocks))


def tensor_layout(shape: Sequence[int], sig: Signature, p: OpPlacement, labels: Optional[Sequence[str]],
                  is_output: bool, index: int) -> Layout:
    """The RVD layout of input or output `index` of an op placed by `p`, on `p.devices`."""
    digits = tensor_digits(sig, p, labels, is_output, index)
    return layout_from_digits(shape, p, digits, tensor_blocks(sig, p, labels, is_output, index, len(shape)))


def partial_grad_groups(p: OpPlacement, digits: Sequence[Digit]) -> DeviceGroups:
    """Device groups across which an input's gradient comes out as partial sums (its PARTITION
    digits), sorted; empty when it has none."""
    if not any(dg.kind is DigitKind.PARTITION for dg in digits):
        return ()
    members: dict[tuple, list[int]] = {}
    for idx in range(p.num_subops):
        key = tuple(None if dg.kind is DigitKind.PARTITION else digit for digit, dg in zip(p.digits(idx), digits))
        members.setdefault(key, []).append(p.devices[idx])
    return tuple(sorted(tuple(sorted(g)) for g in members.values()))


def partial_grad_size(p: OpPlacement, digits: Sequence[Digit]) -> int:
    """How many pieces an input's gradient is a partial sum of (the size of each partial_grad_groups group)."""
    radices = [p.replicate] + [n for _, n in p.splits]
    return math.prod(r for r, dg in zip(radices, digits) if dg.kind is DigitKind.PARTITION)
