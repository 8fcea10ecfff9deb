"""Per-op choices along the mesh's axes, made by passes and placed once.

A pass decides, for some ops, which label an op splits along one axis of the plan's mesh (tensor
parallelism decides the "tp" axis, context parallelism "cp", expert parallelism "ep" and "etp", data
parallelism inside the unit "dp"); the pipeline pass cuts the ops into stages on the "pp" axis.
Nothing is recorded on the builder until `place()`, which turns every op's choices into op_trans
and op_assign calls at once: the sub-ops of every op sit at the mesh coordinates of their axes, so
passes compose (cp x tp x pp, ep x etp x pp) without any of them knowing the others.

Device numbering: a stage of pipeline rank r owns the unit devices r * group .. (r + 1) * group - 1
(the "pp" axis is the unit's outermost); inside, a device's index is row-major over the op's
*view*: by default the mesh's unit axes other than "pp", or what a pass declared for the op (an ep
plan's dense ops see the ep x etp devices as (dense data parallel, tp): Megatron's parallel
folding). An axis an op does not split holds copies of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.mesh import Mesh, MeshLayout, resolve_mesh, subop_devices
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder

View = tuple[tuple[str, int], ...]  # (axis name, size) outer to inner, over one stage's devices


@dataclass(frozen=True)
class AxisSplit:
    """An op split along `label` on one axis (`block` sections split separately, as a fused QKV
    projection must be; `chunks` pieces per device run one after another: co-shard)."""

    label: str
    block: int = 1
    chunks: int = 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its ops in model order and the pipeline rank whose devices run it (None:
    a stage every rank shares, which runs on all the unit's devices: the interlaced pipeline)."""

    ops: tuple[OpHandle, ...]
    rank: Optional[int]


class Parallelization:
    """The choices passes make for one builder (one graph, one mesh), placed by `place()`.

    A builder made with only a unit size (the bare mesh {"dp", "unit"}: a strategy function called
    directly on `PlanBuilder(graph, unit_size=4)`) gets its unit named by the strategy's `layout`
    and its degree `options` (`pp=2, tp=2`), and the builder keeps that mesh."""

    def __init__(self, builder: PlanBuilder, layout: Optional[MeshLayout] = None,
                 options: Optional[Mapping[str, Any]] = None):
        self.builder = builder
        if "unit" in builder.mesh.names and layout is not None:
            inner = resolve_mesh(layout, builder.unit_size, {**dict(options or {}), "dp": 1}, builder.strategy)
            builder.set_mesh(Mesh(("dp",) + inner.unit_names, (builder.dp,) + inner.unit_sizes, 1, inner.folded))
        self.mesh: Mesh = builder.mesh
        self.splits: dict[str, dict[str, AxisSplit]] = {op.name: {} for op in builder.ops}
        self.views: dict[str, View] = {}
        self.stages: Optional[list[Stage]] = None  # set by the pipeline pass
        self.placed = False
        # op name -> its stage, built from the stages it was read from (every pass asks per op, and a
        # scan of every stage's ops for each op grew as ops squared: 20 s for a 126-layer model)
        self._stage_index: tuple[tuple[Stage, ...], dict[str, Stage]] = ((), {})

    # -- the mesh as the passes see it ---------------------------------------------------------------------
    @property
    def ops(self) -> list[OpHandle]:
        return self.builder.ops

    def degree(self, axis: str) -> int:
        return self.mesh[axis]

    @property
    def pp(self) -> int:
        return self.mesh["pp"] if "pp" in self.mesh.unit_names else 1

    @property
    def group_size(self) -> int:
        """Devices per pipeline rank (the whole unit without a pipeline)."""
        return self.mesh.unit_size // self.pp

    def default_view(self) -> View:
        return tuple((n, s) for n, s in zip(self.mesh.unit_names, self.mesh.unit_sizes) if n != "pp")

    def view_of(self, op: OpHandle) -> View:
        stage = self.stage_of(op)
        if stage is not None and stage.rank is None:  # a shared stage: every device of the unit
            return tuple((n, s) for n, s in zip(self.mesh.unit_names, self.mesh.unit_sizes))
        return self.views.get(op.name, self.default_view())

    def set_view(self, op: OpHandle, view: Sequence[tuple[str, int]]) -> None:
        """Let `op` see its stage's devices as `view` (sizes multiplying to the stage's group)."""
        view = tuple((str(n), int(s)) for n, s in view)
        if math.prod(s for _, s in view) != self.group_size:
            raise PlanError(f"a view {dict(view)} of {math.prod(s for _, s in view)} devices does not cover the "
                            f"{self.group_size} devices of a stage", op=op.name, where=op.where())
        self.views[op.name] = view

    def stage_of(self, op: OpHandle) -> Optional[Stage]:
        if self.stages is None:
            return None
        built_from, index = self._stage_index
        # stages are frozen: the same stage objects hold the same ops (held here, so no id is reused)
        if len(built_from) != len(self.stages) or any(a is not b for a, b in zip(built_from, self.stages)):
            index = {}
            for st in self.stages:
                for o in st.ops:
                    index.setdefault(o.name, st)  # the first stage holding an op, as before
            self._stage_index = (tuple(self.stages), index)
        return index.get(op.name)

    def segments(self) -> list[tuple[list[OpHandle], Optional[int]]]:
        """(ops, pipeline rank) per stage, or every op with rank None without a pipeline."""
        if self.stages is None:
            return [(list(self.ops), None)]
        return [(list(st.ops), st.rank) for st in self.stages]

    def devices(self, rank: Optional[int]) -> list[int]:
        """The unit devices of pipeline rank `rank` (None: all of them)."""
        if rank is None:
            return list(range(self.mesh.unit_size))
        return list(range(rank * self.group_size, (rank + 1) * self.group_size))

    # -- recording choices --------------------------------------------------------------------------------
    def split(self, op: OpHandle, axes: Union[str, Iterable[str]], label: str, block: int = 1,
              chunks: int = 1) -> None:
        """Split `op` along `label` on each of `axes` (several axes: nested, the label cut over their
        product), replacing what an earlier pass chose for those axes."""
        for axis in ([axes] if isinstance(axes, str) else list(axes)):
            self.splits[op.name][axis] = AxisSplit(label, int(block), int(chunks))

    def unsplit(self, op: OpHandle, axes: Union[str, Iterable[str], None] = None) -> None:
        """Let `op` run whole along `axes` (default: every axis)."""
        if axes is None:
            self.splits[op.name].clear()
            return
        for axis in ([axes] if isinstance(axes, str) else list(axes)):
            self.splits[op.name].pop(axis, None)

    def choice(self, op: OpHandle, axis: str) -> Optional[AxisSplit]:
        return self.splits[op.name].get(axis)

    def is_split(self, op: OpHandle) -> bool:
        return bool(self.splits[op.name])

    # -- placing -----------------------------------------------------------------------------------------
    def place(self) -> None:
        """Record every op's choices on the builder (op_trans, op_assign); once."""
        if self.placed:
            raise PlanError("the parallelization was placed already; make every choice before place()")
        for ops, rank in self.segments():
            base = 0 if rank is None else rank * self.group_size
            for op in ops:
                self._place(op, self.view_of(op), base)
        self.placed = True

    def _place(self, op: OpHandle, view: View, base: int) -> None:
        b = self.builder
        splits = self.splits[op.name]
        unknown = [a for a in splits if a not in dict(view)]
        if unknown:
            raise PlanError(f"is split along axis {unknown[0]!r}, which its stage's devices {dict(view)} do not have",
                            op=op.name, where=op.where())
        sizes = [s for _, s in view]
        if math.prod(sizes) == 1:
            b.replicate(op, devices=[base])
            return
        copy_axes = [i for i, (n, s) in enumerate(view) if n not in splits and s > 1]
        split_axes = [i for i, (n, s) in enumerate(view) if n in splits and s > 1]
        if not split_axes:
            b.replicate(op, devices=[base + d for d in range(math.prod(sizes))])
            return
        replicate = math.prod(sizes[i] for i in copy_axes)
        if replicate > 1:
            b.op_trans(op, replicate=replicate)
        innermost = split_axes[-1]
        chunks = splits[view[innermost][0]].chunks
        subs = []
        for i in split_axes:
            s = splits[view[i][0]]
            num = sizes[i] * (chunks if i == innermost else 1)
            subs = b.op_trans(op, dim=s.label, num=num, block=s.block)
        for sub, device in zip(subs, subop_devices(sizes, split_axes, chunks)):
            b.op_assign(sub, base + device)
