"""op-trans, op-assign and op-order: the three primitives a plan is written with.

A strategy is a function `fn(builder: PlanBuilder, **options)` that calls `op_trans`/`op_assign`
on the builder's ops, and `op_order` when it pipelines them. The builder records the calls;
`finish()` turns them into a validated `Plan`.

    def my_plan(b, **_):
        for op in b.ops:
            if op.splittable("n"):
                for i, sub in enumerate(op_trans(op, dim="n", num=b.unit_size)):
                    op_assign(sub, i)
            else:
                b.replicate(op)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.knobs import Knobs
from nnscaler_plugins.plan.mesh import Mesh, unit_mesh
from nnscaler_plugins.plan.plan import OpPlacement, PipelineSpec, Plan
from nnscaler_plugins.rules import Signature, op_call, signature_for


@dataclass(frozen=True)
class SubOp:
    """One piece of an op after op_trans; `index` is its flat sub-op number."""

    op: "OpHandle"
    index: int

    @property
    def name(self) -> str:
        return f"{self.op.name}[{self.index}]"

    def __repr__(self) -> str:
        return f"SubOp({self.name})"


class OpHandle:
    """An op as a strategy sees it: the graph node, its signature and the builder it belongs to."""

    def __init__(self, builder: "PlanBuilder", node: OpNode, signature: Signature):
        self.builder = builder
        self.node = node
        self.signature = signature

    name = property(lambda self: self.node.name)
    target = property(lambda self: self.node.target)
    module_path = property(lambda self: self.node.module_path)

    def where(self) -> str:
        return self.node.where()

    def label_of(self, dim: Any) -> str:
        """Resolve `dim` to a signature label.

        Accepts a label string, an int (a dim of output 0), or (input_index, dim) like nnScaler's
        partition(idx=, dim=).
        """
        sig = self.signature
        if isinstance(dim, str):
            if dim not in sig.labels():
                raise PlanError(f"has no dim labelled {dim!r}; its signature labels are {sig.labels()}",
                                op=self.name, where=self.where())
            return dim
        if isinstance(dim, int):
            labs = sig.outputs[0] if sig.outputs and sig.outputs[0] is not None else None
            if labs is None or not -len(labs) <= dim < len(labs):
                raise PlanError(f"output dim {dim} does not exist or is not splittable", op=self.name,
                                where=self.where())
            return labs[dim]
        if isinstance(dim, tuple) and len(dim) == 2:
            i, d = dim
            labs = sig.inputs[i] if i < len(sig.inputs) else None
            if labs is None or not -len(labs) <= d < len(labs):
                raise PlanError(f"input {i} dim {d} is not splittable (input kept whole)", op=self.name,
                                where=self.where())
            return labs[d]
        raise PlanError(f"dim must be a label, an output dim or (input, dim); got {dim!r}", op=self.name,
                        where=self.where())

    def splittable(self, dim: Any, num: int = 2, block: int = 1) -> bool:
        """True when op_trans(self, dim=dim, num=num, block=block) would be accepted."""
        try:
            label = self.label_of(dim)
        except PlanError:
            return False
        if self.signature.is_frozen(label):
            return False
        call = op_call(self.builder.graph, self.node)
        if abs(block) > 1 and self.signature.blockable(label, call) is not None:
            return False
        placement = self.builder._placement(self)
        current = placement.label_counts().get(label, 1)
        block = placement.blocks.get(label, block)
        return self.signature.divides(label, current * num, call, block)

    def __repr__(self) -> str:
        return f"<op {self.name} {self.node.op_name} {self.signature.inputs}->{self.signature.outputs}>"


Transformable = Union[OpHandle, SubOp]


class PlanBuilder:
    """Records primitive calls for one graph and one unit of the plan's devices.

    The devices are the `mesh` (named axes, see mesh.py): `unit_size` devices per model replica,
    `dp` replicas. A builder made with only `unit_size` and `dp` gets the bare mesh
    {"dp": dp, "unit": unit_size}. Typed knobs (`knobs`, see knobs.py) are set with `set_knobs`."""

    def __init__(self, graph: Graph, unit_size: Optional[int] = None, dp: int = 1, strategy: str = "custom",
                 options: Optional[dict] = None, micro_batches: int = 1, zero: int = 0, precision: str = "fp32",
                 mesh: Optional[Mesh] = None, knobs: Optional[Knobs] = None):
        if mesh is None:
            if unit_size is None:
                raise PlanError("a PlanBuilder needs a mesh= (or unit_size= and dp=)")
            if unit_size < 1 or dp < 1:
                raise PlanError(f"unit size and data-parallel degree must be >= 1 (got {unit_size}, {dp})")
            mesh = unit_mesh(unit_size, dp)
        elif unit_size is not None and (unit_size, dp) != (mesh.unit_size, mesh.replicas):
            raise PlanError(f"unit_size={unit_size}, dp={dp} disagree with the mesh {mesh.describe()} "
                            f"({mesh.replicas} replica(s) of {mesh.unit_size} devices)")
        self.graph = graph
        self.mesh = mesh
        self.unit_size = mesh.unit_size
        self.dp = mesh.replicas
        self.knobs = knobs or Knobs()
        self.strategy = strategy
        self.options = dict(options or {})
        self.ops = [OpHandle(self, node, signature_for(graph, node)) for node in graph.ops]
        self._by_name = {h.name: h for h in self.ops}
        self._placements: dict[str, OpPlacement] = {}
        self._subop_splits: dict[str, dict[int, list[tuple[str, int]]]] = {}
        self.micro_batches = int(micro_batches)
        self.pipeline: Optional[PipelineSpec] = None
        self.zero_stage = zero
        self.precision_name = precision

    def zero(self, stage: int) -> None:
        """Shard optimizer state (1), + gradients (2), + parameters (3) across data-parallel replicas."""
        self.zero_stage = stage

    def precision(self, name: str) -> None:
        """Compute precision: "fp32", or "bf16" / "fp16" with fp32 master weights in the optimizer."""
        self.precision_name = name

    def set_knobs(self, **changes: Any) -> None:
        """Set typed knobs of the plan (`plan.knobs`: cp_comm, capacity_factor, sequence_parallel, ...);
        an unknown name is refused with the name meant."""
        self.knobs = self.knobs.replace(**changes)

    def set_mesh(self, mesh: Mesh) -> None:
        """Name the unit's axes once they are known (the search decides them for `auto`); the unit and
        the replicas stay what they are."""
        if (mesh.unit_size, mesh.replicas) != (self.unit_size, self.dp):
            raise PlanError(f"mesh {mesh.describe()} has {mesh.replicas} replica(s) of {mesh.unit_size} devices; this "
                            f"plan's are {self.dp} of {self.unit_size}")
        self.mesh = mesh

    @property
    def world_size(self) -> int:
        return self.unit_size * self.dp

    def op(self, name: str) -> OpHandle:
        return self._by_name[name]

    def _placement(self, op: OpHandle) -> OpPlacement:
        return self._placements.setdefault(op.name, OpPlacement())

    # -- primitives -------------------------------------------------------------------------------
    def op_trans(self, target: Transformable, dim: Any = None, num: Optional[int] = None,
                 replicate: Optional[int] = None, block: int = 1) -> list[SubOp]:
        op = target.op if isinstance(target, SubOp) else target
        if not isinstance(op, OpHandle):
            raise TypeError(f"op_trans expects an op or sub-op from this builder, got {type(target).__name__}")
        p = self._placement(op)
        if any(d is not None for d in p.devices):
            raise PlanError("op_trans after op_assign: transform an op fully before assigning its pieces",
                            op=op.name, where=op.where())
        if replicate is not None:
            if dim is not None or num is not None:
                raise PlanError("op_trans takes either replicate= or dim= and num=, not both", op=op.name,
                                where=op.where())
            if p.splits:
                raise PlanError("replicate= must come before any split of the op", op=op.name, where=op.where())
            p.replicate *= int(replicate)
        else:
            if dim is None or num is None:
                raise PlanError("op_trans needs dim= and num= (or replicate=)", op=op.name, where=op.where())
            label = op.label_of(dim)
            if op.signature.is_frozen(label):
                raise PlanError(f"dim {label!r} is frozen by the op's rule ({op.signature.note or 'it must stay whole'})",
                                op=op.name, where=op.where())
            if block != 1:
                why = op.signature.blockable(label, op_call(self.graph, op.node)) if abs(block) > 1 else \
                    "block must be >= 2 (or <= -2: mirrored)"
                if why is not None:
                    raise PlanError(f"cannot split dim {label!r} in {block} blocks: {why}", op=op.name,
                                    where=op.where())
                if p.blocks.get(label, block) != block:
                    raise PlanError(f"dim {label!r} is already split in {p.blocks[label]} blocks; nested splits "
                                    f"of one dim use one block factor (got {block})", op=op.name, where=op.where())
                p.blocks[label] = block
            if isinstance(target, SubOp):
                # A nested split of one sub-op: recorded per sub-op and required to be uniform
                # across siblings when the plan is finished (layouts are uniform splits).
                self._subop_splits.setdefault(op.name, {}).setdefault(target.index, []).append((label, int(num)))
                siblings = self._subop_splits[op.name]
                if len(siblings) < p.num_subops:
                    return [SubOp(op, -1)]  # placeholder until every sibling got the same split
                first = next(iter(siblings.values()))
                if any(v != first for v in siblings.values()):
                    raise PlanError("nested op_trans must split every sub-op of the op the same way "
                                    f"(got {siblings}); uneven splits are not representable as layouts",
                                    op=op.name, where=op.where())
                del self._subop_splits[op.name]
                for l, n in first:
                    p.splits.append((l, n))
            else:
                p.splits.append((label, int(num)))
        p.devices = [None] * p.num_subops
        return [SubOp(op, i) for i in range(p.num_subops)]

    def op_assign(self, sub: SubOp, device: int) -> None:
        if not isinstance(sub, SubOp) or sub.index < 0:
            raise PlanError(f"op_assign expects a sub-op returned by op_trans, got {sub!r}")
        p = self._placement(sub.op)
        p.devices[sub.index] = int(device)

    # -- conveniences strategies use ----------------------------------------------------------------
    def replicate(self, op: OpHandle, devices: Optional[list[int]] = None) -> None:
        """Run the whole op on each of `devices` (default: every device of the unit)."""
        devices = list(range(self.unit_size)) if devices is None else list(devices)
        subs = self.op_trans(op, replicate=len(devices)) if len(devices) > 1 else [SubOp(op, 0)]
        self._placement(op)
        for s, d in zip(subs, devices):
            self.op_assign(s, d)

    def split(self, op: OpHandle, dims: list[tuple[Any, int]], devices: Optional[list[int]] = None) -> None:
        """Nested split along `dims` ([(dim, num), ...]) with sub-op i on devices[i]."""
        subs: list[SubOp] = [SubOp(op, 0)]
        for dim, num in dims:
            subs = self.op_trans(op, dim=dim, num=num)
        devices = list(range(len(subs))) if devices is None else list(devices)
        for s, d in zip(subs, devices):
            self.op_assign(s, d)

    def placement(self, op: OpHandle) -> OpPlacement:
        return self._placement(op)

    def recompute(self, ops: Sequence[Union[OpHandle, str]]) -> int:
        """Recompute these ops in backward instead of keeping their activations (one group: run
        together under a checkpoint). Returns the group's number."""
        group = 1 + max((p.recompute for p in self._placements.values() if p.recompute is not None), default=-1)
        for op in ops:
            handle = self._by_name[op] if isinstance(op, str) else op
            self._placement(handle).recompute = group
        return group

    def op_order(self, stages: Sequence[Sequence[Union[OpHandle, str]]], devices: Sequence[Sequence[int]], *,
                 micro_batches: Optional[int] = None, schedule: Union[str, Callable[..., Any]] = "1f1b",
                 stage_rank: Optional[Sequence[int]] = None, split_backward: Optional[bool] = None,
                 **options: Any) -> PipelineSpec:
        """Pipeline the ops: stage k (ops in model order) runs on `devices[k]`, micro-batches flow
        through the stages in the order `schedule` gives (a built-in name or a function
        `fn(shape, **options) -> per-rank task lists`). Stages sharing a device group share a
        pipeline rank (interleaved chunks). The schedule is dry-run here, so a broken one fails now.
        """
        from nnscaler_plugins.plan.schedules import SPLITS_BACKWARD
        from nnscaler_plugins.plan.timeline import check

        if len(stages) != len(devices):
            raise PlanError(f"op_order got {len(stages)} stages but {len(devices)} device groups")
        m = self.micro_batches if micro_batches is None else int(micro_batches)
        seen: dict[str, int] = {}
        for k, ops in enumerate(stages):
            if not ops:
                raise PlanError(f"pipeline stage {k} has no ops")
            for op in ops:
                handle = self._by_name[op] if isinstance(op, str) else op
                if handle.name in seen:
                    raise PlanError(f"is in pipeline stages {seen[handle.name]} and {k}; an op belongs to one stage",
                                    op=handle.name, where=handle.where())
                seen[handle.name] = k
                self._placement(handle).stage = k
        missing = [h for h in self.ops if h.name not in seen]
        if missing:
            raise PlanError(f"is in no pipeline stage ({len(missing)} ops are not); give every op a stage",
                            op=missing[0].name, where=missing[0].where())
        for k, group in enumerate(devices):
            bad = [d for d in group if not 0 <= d < self.unit_size]
            if bad or not group:
                raise PlanError(f"pipeline stage {k} is given devices {list(group)}, outside this plan's unit "
                                f"(devices 0..{self.unit_size - 1})")
        name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
        split = name in SPLITS_BACKWARD if split_backward is None else bool(split_backward)
        spec = PipelineSpec([list(map(int, g)) for g in devices], m, name,
                            list(stage_rank) if stage_rank is not None else [], split,
                            {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))})
        groups: dict[int, tuple[int, ...]] = {}
        for k, (r, g) in enumerate(zip(spec.stage_rank, spec.stage_devices)):
            if r >= 0 and groups.setdefault(r, tuple(g)) != tuple(g):
                raise PlanError(f"pipeline stage {k} runs on rank {r} with devices {g}, but another stage of rank "
                                f"{r} has devices {list(groups[r])}; one rank is one device group")
        flat = [d for g in groups.values() for d in g]
        if len(flat) != len(set(flat)):
            raise PlanError(f"pipeline ranks share devices ({[list(g) for g in groups.values()]}); each device "
                            "belongs to one pipeline rank")
        for k, (r, g) in enumerate(zip(spec.stage_rank, spec.stage_devices)):
            if r < 0 and sorted(g) != sorted(flat):
                raise PlanError(f"pipeline stage {k} is shared by every rank, so it must run on all their devices "
                                f"{sorted(flat)} (given {list(g)})")
        try:
            if callable(schedule):
                from nnscaler_plugins.plan.schedules import build
                spec.tasks = build(schedule, spec.shape(), **options)
            lists = spec.task_lists()
        except ValueError as e:
            raise PlanError(f"schedule {name!r}: {e}") from None
        check(lists, spec.shape())
        self.pipeline = spec
        return spec

    def finish(self, validate: bool = True) -> Plan:
        pending = [n for n, s in self._subop_splits.items() if s]
        if pending:
            op = self._by_name[pending[0]]
            raise PlanError("nested op_trans was applied to only some sub-ops; split every sub-op the same way",
                            op=op.name, where=op.where())
        plan = Plan(graph_fingerprint=self.graph.fingerprint(), model_class=self.graph.model_class,
                    structure_fingerprint=self.graph.structure_fingerprint(),
                    unit_size=self.unit_size, dp=self.dp,
                    ops={h.name: self._placements.get(h.name, OpPlacement()) for h in self.ops},
                    strategy=self.strategy, options=self.options, pipeline=self.pipeline, mesh=self.mesh,
                    knobs=self.knobs,
                    micro_batches=self.pipeline.micro_batches if self.pipeline else self.micro_batches,
                    zero=self.zero_stage, precision=self.precision_name,
                    input_shapes={i.path[1] if len(i.path) == 2 else ".".join(map(str, i.path[1:])):
                                  list(self.graph.meta(i.name).shape)
                                  for i in self.graph.inputs if self.graph.values[i.name].meta is not None})
        plan.graph = self.graph
        if validate:
            from nnscaler_plugins.plan.validate import validate as _validate
            _validate(plan, self.graph)
        return plan


# Free-function spellings of the primitives (the paper's names), bound to the op's builder.
def op_trans(op: Transformable, dim: Any = None, num: Optional[int] = None,
             replicate: Optional[int] = None, block: int = 1) -> list[SubOp]:
    """Split `op` along `dim` into `num` sub-ops, or copy it `replicate` times. Nested calls compose.

    `block=b` views the dim as b equal blocks and gives each sub-op its chunk of every block: a
    fused projection (q, k and v side by side) split this way leaves each device whole heads of
    each of q, k and v, so the `split` into q, k, v that follows runs locally.
    """
    builder = (op.op if isinstance(op, SubOp) else op).builder
    return builder.op_trans(op, dim=dim, num=num, replicate=replicate, block=block)


def op_order(stages: Any, devices: Any, *rest: Any, **schedule: Any) -> PipelineSpec:
    """Order the ops on their devices as a pipeline: stage k (ops in model order) runs on the device
    group `devices[k]`, and micro-batches go through the stages in the order a schedule gives
    (`schedule="1f1b"`, another built-in name, or `fn(shape, **options) -> per-rank task lists`;
    `micro_batches=`, ...; see `PlanBuilder.op_order`).

        half = len(builder.ops) // 2
        op_order([builder.ops[:half], builder.ops[half:]], [[0], [1]], schedule="gpipe", micro_batches=4)

    Like `op_trans` and `op_assign`, it finds the builder from the ops it is given; a stage may
    name an op by its name once another op of the call is an op handle. `op_order(builder, stages,
    devices, ...)` (the builder first) is accepted too, and needed when every op is a name.
    """
    if "builder" in schedule:  # op_order(builder=..., stages=..., devices=...)
        return schedule.pop("builder").op_order(stages, devices, *rest, **schedule)
    if isinstance(stages, PlanBuilder):
        if len(rest) != 1:
            raise TypeError("op_order(builder, stages, devices, **schedule) takes stages and devices after the builder")
        return stages.op_order(devices, rest[0], **schedule)
    if rest:
        raise TypeError(f"op_order takes stages and devices, then keyword options; got {len(rest)} more positional")
    builder = next((op.builder for ops in stages for op in ops if isinstance(op, OpHandle)), None)
    if builder is None:
        raise TypeError("op_order found no op handle in its stages (only names): pass op handles "
                        "(builder.ops) or call builder.op_order(stages, devices, ...)")
    return builder.op_order(stages, devices, **schedule)


def op_assign(sub: SubOp, device: int) -> None:
    """Place a sub-op on a device of the unit (0 <= device < unit_size)."""
    sub.op.builder.op_assign(sub, device)
