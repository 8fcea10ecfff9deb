"""Dimension signatures: how an op may be split.

A signature gives every dim of every tensor input and output a *label*. Splitting an op along a
label `l` into `num` pieces splits every tensor dim that carries `l` into `num` equal chunks (piece
`i` gets chunk `i`) and leaves tensors without `l` whole. What the outputs then hold depends on the
label's kind:

- spatial (default): outputs carrying `l` are split the same way; each piece computes its chunk.
- reduce: `l` is summed over by the op (the `k` of a matmul). Outputs lack `l`, so each piece
  computes a *partial sum*; the pieces add up to the whole output. Inputs without `l` that the op
  adds once (a bias) are listed in `partial_inputs[l]`: they enter as partial sums too (the value
  on piece 0, zeros elsewhere), so they are counted once.
- frozen: `l` may not be split (softmax's dim, a layer norm's normalized dims).

Labels are plain strings. By convention a label starting with "^" is frozen, so rules can write
`("b", "s", "^h")`. Broadcast dims of size 1 get their own frozen label.

`value_inputs` marks ops that are linear in some inputs (add, sub, neg, view, transpose, sum, ...):
when those inputs arrive as partial sums the op may run on each partial and its outputs are partial
sums as well, with no communication. Inputs not listed must then be whole (replicated).

`blocks[(label, input_index)] = b` marks an input dim that must be split as a *blocked* (strided)
split: the dim is viewed as `b` equal blocks and every piece takes its chunk of each block. This is
how `split`/`chunk` into `b` equal sections (a fused QKV projection cut into q, k, v) can run on
pieces: each output section is then split contiguously.

A tensor argument that is not data for the op -- it only provides a dtype, a device or a size
(`type_as`'s second tensor, the `self` of `new_zeros`, a grouped matmul's offsets) -- never shares
a label with the output: its dims get frozen labels of their own (`broadcast.provider_labels`), or
`None` when it must arrive whole. Labelling it like data would ask the plan to split it along with
the output, which its shape has nothing to do with.

A label may carry different sizes on different tensors (a reshape's merged dim and the leading dim
it becomes; grouped-query attention's query and key heads): a split must divide all of them.

`merged[l] = (host, b)` says that a label lives inside another tensor's dim: a reshape merging
(b, h) into b*h labels h with `l` and b*h with `host`; splitting `l` splits the merged dim of the
tensors that lack `l` in b blocks (`lower.placement.label_digit` reads it), so a split of heads
survives BLOOM's (batch * heads) fold and its way back.

When the plain op is not what a piece must run (a vocabulary-parallel embedding must shift and
mask its ids; a mean over a split dim must divide by the global count), `localize` returns the
target and arguments each piece runs. It receives a `LocalCall` describing the piece. If the piece
needs to talk to the other pieces (vocabulary-parallel cross-entropy), `Localized.group_label`
names the split label whose device group is passed as the keyword argument `group`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from nnscaler_plugins.capture.graph import OpNode, Ref, TensorMeta

Labels = tuple[str, ...]


@dataclass(frozen=True)
class OpCall:
    """What a rule sees: the op, its arguments (tensors as `Ref`), and tensor metadata."""

    target: Any
    args: tuple
    kwargs: Mapping[str, Any]
    inputs: tuple[TensorMeta, ...]  # tensor inputs in (args, kwargs) order, same order as OpNode.inputs
    outputs: tuple[Optional[TensorMeta], ...]  # one per output element (None: non-tensor / unused)
    input_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, op: OpNode, metas: Mapping[str, TensorMeta], output_metas: Sequence[Optional[TensorMeta]]) -> "OpCall":
        return cls(op.target, op.args, op.kwargs, tuple(metas[n] for n in op.inputs), tuple(output_metas),
                   tuple(op.inputs))

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument by position or keyword, as the schema allows either."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def input_index(self, ref: Any) -> Optional[int]:
        """Position of a `Ref` argument among the tensor inputs (None when it is not a tensor)."""
        if isinstance(ref, Ref) and ref.name in self.input_names:
            return self.input_names.index(ref.name)
        return None


@dataclass(frozen=True)
class KernelChoices:
    """What the plan chose for the group-aware kernels a piece may run (from the plan's typed knobs,
    set by the lowering): how context-parallel attention meets its keys, the experts' capacity."""

    cp_comm: str = "ring"
    capacity_factor: Optional[float] = None


@dataclass(frozen=True)
class LocalCall:
    """One piece of a split op, handed to `Signature.localize`."""

    call: OpCall
    splits: Mapping[str, int]  # label -> number of pieces along it (nested splits multiply)
    index: Mapping[str, int]  # label -> this piece's index along it
    local_inputs: tuple[TensorMeta, ...]  # shapes this piece sees
    local_outputs: tuple[Optional[TensorMeta], ...]  # shapes this piece must produce
    blocks: Mapping[str, int] = field(default_factory=dict)  # label -> the plan's block count (< 0: mirrored)
    kernels: KernelChoices = KernelChoices()  # the plan's choices for group-aware kernels


@dataclass(frozen=True)
class Localized:
    target: Any
    args: tuple
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    group_label: Optional[str] = None  # pass the device group of this split label as kwarg `group`


@dataclass(frozen=True)
class Signature:
    inputs: tuple[Optional[Labels], ...]  # per tensor input; None = must stay whole (replicated)
    outputs: tuple[Optional[Labels], ...]  # per output element; None for non-tensor outputs
    reduce: frozenset[str] = frozenset()
    partial_inputs: Mapping[str, frozenset[int]] = field(default_factory=dict)
    value_inputs: frozenset[int] = frozenset()
    localize: Optional[Callable[[LocalCall], Localized]] = None
    # Labels whose split requires `localize` to return a group-aware kernel (for messages/search).
    comm_labels: frozenset[str] = frozenset()
    blocks: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # label -> (host label, b): on a tensor that lacks `label` but carries `host`, splitting `label`
    # splits the host's dim in b blocks (a reshape merging (b, h) into b*h with h split).
    merged: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # Reduce or group-aware labels whose pieces need no offsets: any equal share of the indices
    # gives the same partial result (a sum; a mean over the global count), so a plan may split them
    # in blocks (the flattened logits' rows of a sequence split mirrored, see `blockable`).
    order_free: frozenset[str] = frozenset()
    # Inputs that count the rows of the op's other inputs (a sorted-experts op's rows per expert):
    # computed from the same rows, so each data-parallel replica keeps its own (never a batch
    # statistic to be made whole across replicas, see passes/batch_statistics.py).
    row_counts: frozenset[int] = frozenset()
    # Labels that may only be split if every label in the tuple divides; informative for search.
    note: str = ""

    # -- queries -----------------------------------------------------------------------------
    def labels(self) -> list[str]:
        """All labels in first-appearance order (inputs then outputs)."""
        seen: list[str] = []
        for lab in list(self.inputs) + list(self.outputs):
            for l in lab or ():
                if l not in seen:
                    seen.append(l)
        return seen

    def is_frozen(self, label: str) -> bool:
        return label.startswith("^")

    def splittable(self) -> list[str]:
        return [l for l in self.labels() if not self.is_frozen(l)]

    def kind(self, label: str) -> str:
        if self.is_frozen(label):
            return "frozen"
        return "reduce" if label in self.reduce else "spatial"

    def size_of(self, label: str, call: OpCall) -> int:
        """The largest piece count bound for `label`: the gcd of every dim length carrying it, so a
        number of pieces divides this exactly when it divides every such dim."""
        found = 0
        for metas, labs in ((call.inputs, self.inputs), (call.outputs, self.outputs)):
            for m, lab in zip(metas, labs):
                if m is not None and lab:
                    for d, l in enumerate(lab):
                        if l == label:
                            found = math.gcd(found, m.shape[d])
        if not found:
            raise KeyError(label)
        return found

    def divides(self, label: str, num: int, call: OpCall, block: int = 1) -> bool:
        """True when `num` pieces split every dim carrying `label` evenly (blocked dims per block).

        `block` is a plan's own blocked split of the label (see `blockable`); the rule's blocks
        for an input take precedence over it.
        """
        for k, (metas, labs) in enumerate(((call.inputs, self.inputs), (call.outputs, self.outputs))):
            for i, (m, lab) in enumerate(zip(metas, labs)):
                if m is None or not lab:
                    continue
                for d, l in enumerate(lab):
                    if l == label:
                        b = self.blocks.get((label, i), block) if k == 0 else block
                        if m.shape[d] % (num * b):
                            return False
        return True

    def blockable(self, label: str, call: OpCall) -> Optional[str]:
        """Why a plan may not split `label` in blocks, or None when it may.

        A blocked split hands each piece a strided subset of the indices instead of a contiguous
        range. That is only the same computation for a spatial label every tensor carries with one
        size (index i of an input feeds index i of the output, so any subset of indices works) and
        whose pieces do not need their own offsets (reductions and group-aware kernels do).
        """
        if self.is_frozen(label):
            return f"dim {label!r} is frozen"
        if (label in self.reduce or label in self.comm_labels) and label not in self.order_free:
            return f"dim {label!r} is a reduction; only spatial dims may be split in blocks"
        if any(l == label for l, _ in self.blocks):
            return f"the op's rule already fixes the blocks of dim {label!r}"
        sizes = set()
        for metas, labs in ((call.inputs, self.inputs), (call.outputs, self.outputs)):
            for m, lab in zip(metas, labs):
                if m is not None and lab:
                    sizes |= {m.shape[d] for d, l in enumerate(lab) if l == label}
        if len(sizes) > 1:
            return f"dim {label!r} has different sizes {sorted(sizes)} on the op's tensors (a reshape)"
        return None

    def dims_of(self, label: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(input_index, dim) and (output_index, dim) pairs carrying `label`."""
        ins = [(i, d) for i, lab in enumerate(self.inputs) for d, l in enumerate(lab or ()) if l == label]
        outs = [(i, d) for i, lab in enumerate(self.outputs) for d, l in enumerate(lab or ()) if l == label]
        return ins, outs

    def check(self, call: OpCall) -> None:
        """Raise ValueError if the signature does not fit the call's shapes (a rule bug)."""
        if len(self.inputs) != len(call.inputs):
            raise ValueError(f"signature has {len(self.inputs)} inputs, op has {len(call.inputs)}")
        if len(self.outputs) != len(call.outputs):
            raise ValueError(f"signature has {len(self.outputs)} outputs, op has {len(call.outputs)}")
        sizes: dict[str, int] = {}
        for metas, labs in ((call.inputs, self.inputs), (call.outputs, self.outputs)):
            for m, lab in zip(metas, labs):
                if lab is None or m is None:
                    continue
                if len(lab) != m.ndim:
                    raise ValueError(f"labels {lab} do not match shape {m.shape}")
                for l, s in zip(lab, m.shape):
                    sizes.setdefault(l, s)
        for l in self.reduce:
            _, outs = self.dims_of(l)
            if outs:
                raise ValueError(f"reduce label {l!r} appears in an output")


def replicate_only(call: OpCall) -> Signature:
    """The signature of an op that may only be replicated (every dim frozen)."""
    return Signature(
        inputs=tuple(None for _ in call.inputs),
        outputs=tuple(None for _ in call.outputs),
        note="replicate-only",
    )
