"""Lowering: Plan + Graph -> one Program per unit rank, keeping every data dependency.

For every op input, the layout its producer left the tensor in is compared with the layout the
consuming sub-op needs on the same devices, and the cheapest resharding between the two is
inserted (nothing when they match). Inputs that a split op uses whole on several pieces get their
gradient summed across those pieces in backward: for parameters this is the gradient reducer's
job (bucketed, overlapped); for activations a backward all-reduce is inserted. The result is plain
data that codegen prints and the runtime executes; it is computed identically on every rank, so
every rank knows every process group it must create.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.utils._pytree as pytree

from nnscaler_plugins.capture.graph import Graph, OpNode, Ref, TensorMeta
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.lower.placement import (
    layout_from_digits,
    merged_host,
    partial_grad_groups,
    tensor_blocks,
    tensor_digits,
    tensor_layout,
)
from nnscaler_plugins.lower import expert_overlap, grouped_query, tp_overlap
from nnscaler_plugins.plan.float8 import float8_linears
from nnscaler_plugins.lower.resharding import ReshardPlan
from nnscaler_plugins.lower.resharding import plan as plan_reshard
from nnscaler_plugins.plan.plan import OpPlacement, Plan
from nnscaler_plugins.kernels.batch_norm_statistics import KERNELS as BATCH_NORM_KERNELS
from nnscaler_plugins.kernels.piece_rng import forward_token
from nnscaler_plugins.kernels.replica_statistics import across_replicas
from nnscaler_plugins.lower.random_ops import add_forward_tokens, random_op_keys, seed_piece
from nnscaler_plugins.rules.signature import KernelChoices
from nnscaler_plugins.rules import (
    LocalCall,
    Localized,
    Signature,
    op_call,
    signature_for,
)


@dataclass
class OpLayouts:
    """Per sub-op view of one op: which device runs which piece, and every tensor's layout."""

    devices: list[int]
    inputs: list[Optional[Layout]]
    outputs: list[Optional[Layout]]
    # per input: groups of devices over which this input's gradient comes out partial
    grad_partial: list[tuple[tuple[int, ...], ...]]
    label_groups: dict[str, tuple[tuple[int, ...], ...]]  # label -> device groups of pieces along it


@dataclass
class CoShardCall:
    """An op whose device runs `chunks` pieces one after another (co-shard).

    `pieces[j]` is what piece j runs; `in_modes` says, per tensor input, how piece j gets its part
    of the device's local input: ("chunk", dims, blocks) cut along the co-sharded dims, ("first",)
    the value for piece 0 and zeros for the others (an input added once, a bias), or ("whole",).
    `out_modes` says how the pieces' outputs make the device's: ("cat", dim, blocks), ("sum",) for
    partial sums, or ("first",) for copies. `in_vars` names the local inputs, in op-input order.
    """

    chunks: int
    pieces: list[tuple[Any, tuple, dict]]
    in_modes: list[tuple]
    out_modes: list[Optional[tuple]]
    in_vars: list[str]


@dataclass
class Stmt:
    kind: str  # "op" | "reshard" | "grad_sum" | "del"
    out: list[Optional[str]] = field(default_factory=list)
    target: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    src: Optional[str] = None  # input var for reshard / grad_sum
    key: int = -1  # index into Program.reshards or Program.grad_groups
    op: Optional[OpNode] = None
    grad_enabled: bool = True
    group_kwarg: Optional[int] = None  # index into Program.kernel_groups, passed as group=
    comment: str = ""
    output_of: Optional[int] = None  # index of the model output this statement only serves
    coshard: Optional[CoShardCall] = None
    recompute: Optional[int] = None  # the recompute group of the op this statement serves
    # a kernel call standing for collectives the lowering found next to matmuls (lower/tp_overlap.py):
    # the reshards it runs in forward (by key, for counting; None: not such a call), and whether it
    # returns its outputs as a tuple
    fused_reshards: Optional[tuple[int, ...]] = None
    tuple_out: bool = False


@dataclass
class ParamShard:
    """Where one parameter, buffer or constant is stored: one copy per pipeline rank that uses it
    (tied weights used by two stages, an embedding and its LM head, have two copies)."""

    value: str  # the graph value (the variable generated code reads)
    fqn: str
    aliases: tuple[str, ...]
    kind: str  # "param" | "buffer" | "constant"
    layout: Layout
    grad_groups: tuple[tuple[int, ...], ...] = ()  # unit device groups to sum gradients over
    persistent: bool = True  # part of the model's state dict (non-persistent buffers are not)
    # Unit device groups whose gradients are summed by the reducer: the grad groups, joined across
    # the copies of a tied weight so that every copy steps with the sum of all copies' gradients.
    reduce_groups: tuple[tuple[int, ...], ...] = ()
    tied: bool = False  # one of several copies on different pipeline ranks

    @property
    def in_state_dict(self) -> bool:
        return self.kind == "param" or (self.kind == "buffer" and self.persistent)

    def reduce_group(self, device: int) -> tuple[int, ...]:
        return next((g for g in self.reduce_groups if device in g), (device,))


@dataclass
class StageProgram:
    """The code one device runs for one pipeline stage (the whole model when there is no pipeline).

    The stage function takes `inputs` (graph inputs the stage reads, then the boundary values it
    receives, whole) and returns `sent` (boundary values later stages read, made whole on this
    stage's devices) followed by one entry per model output (None where another stage makes it).
    """

    stage: int
    device: int
    stmts: list[Stmt]
    inputs: list[str]
    sent: list[str]  # var names of the boundary values, in Program.stage_sends[stage] order
    outputs: list[Optional[str]]  # per model output: this stage's var, or None
    params: list[str]  # shard keys the stage reads


@dataclass
class RankProgram:
    device: int
    stages: dict[int, StageProgram]
    params: list[str]  # shard keys held on this device (every stage it runs)

    # The single-stage view, for plans without a pipeline.
    @property
    def stmts(self) -> list[Stmt]:
        return self.stages[0].stmts

    @property
    def inputs(self) -> list[str]:
        return self.stages[0].inputs

    @property
    def outputs(self) -> list[Optional[str]]:
        return self.stages[0].outputs


@dataclass(frozen=True)
class Boundary:
    """A value made in one stage and read in later ones: sent whole, its gradient sent back."""

    value: str
    src: int
    dsts: tuple[int, ...]
    requires_grad: bool


@dataclass
class Program:
    graph: Graph
    plan: Plan
    unit_size: int
    ranks: list[RankProgram]
    shards: dict[str, ParamShard]
    reshards: list[ReshardPlan]
    grad_groups: list[tuple[tuple[int, ...], ...]]
    kernel_groups: list[tuple[tuple[int, ...], ...]]
    loss_index: Optional[int]
    stage_groups: list[tuple[int, ...]] = field(default_factory=list)  # devices of each stage
    boundaries: list[Boundary] = field(default_factory=list)
    stage_inputs: list[list[str]] = field(default_factory=list)  # per stage: graph inputs, then boundary values
    stage_sends: list[list[str]] = field(default_factory=list)  # per stage: boundary values it sends
    output_stage: list[Optional[int]] = field(default_factory=list)  # per model output: the stage making it
    # kernel_groups keys whose group is each device's data-parallel replicas (batch statistics)
    replica_kernels: list[int] = field(default_factory=list)

    @property
    def draws(self) -> bool:
        """Whether some device's program seeds random ops (`lower/random_ops.py`): every rank then
        agrees on the base seed when its module is built."""
        return any(s.target is forward_token for rp in self.ranks for sp in rp.stages.values() for s in sp.stmts)

    @property
    def num_stages(self) -> int:
        return len(self.stage_groups)

    def tables_key(self) -> tuple:
        """The communication tables and storage less the sizes. Generated code names its
        collectives by index into these tables, so a file generated at other input sizes runs
        with this Program's tables only where the keys agree (see runtime/batch_shapes.py)."""
        shards = tuple(sorted((s.value, s.kind, s.layout.group, s.layout.replicas, s.layout.partial,
                               s.layout.splits, s.layout.blocks, s.grad_groups) for s in self.shards.values()))
        return (tuple(r.shape_free() for r in self.reshards), tuple(self.grad_groups), tuple(self.kernel_groups),
                tuple(self.replica_kernels), shards)

    def groups_needed(self) -> list[tuple[int, ...]]:
        """Every unit-relative rank tuple any collective uses, sorted (creation order)."""
        out: set[tuple[int, ...]] = set()
        for r in self.reshards:
            out |= {tuple(g) for g in r.groups_needed()}
        for gs in self.grad_groups + self.kernel_groups:
            out |= {tuple(g) for g in gs}
        for s in self.shards.values():
            out |= {tuple(g) for g in s.grad_groups}
        return sorted((g for g in out if len(g) > 1), key=lambda g: (len(g), g))

    def forward_communicates(self, device: int = 0) -> bool:
        """Whether `device`'s forward runs any collective of its own (a reshard, or a kernel over a
        group). Without one, no input of a backward was all-gathered (nothing to keep as a shard), and a
        rank may start its forward while a step-level collective is still in flight."""
        return bool(self.collective_counts(device))

    def forward_is_local(self, device: int = 0) -> bool:
        """Whether `device`'s forward only computes its outputs: no collective of its own, no random
        draws (their streams advance), no buffer, weight or input written in place (batch-norm running
        statistics). Such a forward can run on some ranks and be thrown away (its step refused by
        another rank) without the ranks drifting apart."""
        if self.forward_communicates(device) or self.draws:
            return False
        for op in self.graph.ops:
            name = op.short_name
            if "batch_norm" in name:
                return False
            if name.endswith("_") and op.inputs and self.graph.values[op.inputs[0]].kind != "op":
                return False
        return True

    def collective_counts(self, device: int = 0):
        """Collectives this device runs in one forward (by kind), for tests and explain()."""
        from collections import Counter
        c: Counter = Counter()
        for sp in self.ranks[device].stages.values():
            for s in sp.stmts:
                if s.kind == "reshard":
                    c.update(self.reshards[s.key].count())
                elif s.fused_reshards is not None:  # collectives run by a kernel next to the matmuls they overlap
                    for key in s.fused_reshards:
                        c.update(self.reshards[key].count())
                elif s.kind == "op" and s.group_kwarg is not None:
                    c["kernel:" + getattr(s.target, "__name__", str(s.target))] += 1
        return c


# ---------------------------------------------------------------------------------------------------
def op_layouts(graph: Graph, op: OpNode, p: OpPlacement, sig: Signature) -> OpLayouts:
    """Every tensor's layout under `p` (see `placement`), and the device groups along each split label."""
    try:
        return _op_layouts(graph, op, p, sig)
    except ValueError as e:  # a split the layouts cannot hold (one merged dim cut along two labels)
        raise PlanError(f"its split {p.splits} has no layout: {e}", op=op.name, where=op.where()) from None


def _op_layouts(graph: Graph, op: OpNode, p: OpPlacement, sig: Signature) -> OpLayouts:
    ins: list[Optional[Layout]] = []
    grads: list[tuple[tuple[int, ...], ...]] = []
    for i, name in enumerate(op.inputs):
        labels = sig.inputs[i]
        shape = graph.meta(name).shape
        digits = tensor_digits(sig, p, labels, False, i)
        ins.append(layout_from_digits(shape, p, digits, tensor_blocks(sig, p, labels, False, i, len(shape))))
        grads.append(partial_grad_groups(p, digits))
    outs: list[Optional[Layout]] = []
    for j, name in enumerate(op.outputs):
        if name is None:
            outs.append(None)
            continue
        labels = sig.outputs[j] if j < len(sig.outputs) else None
        outs.append(tensor_layout(graph.meta(name).shape, sig, p, labels, True, j))
    label_groups: dict[str, tuple[tuple[int, ...], ...]] = {}
    for label in {l for l, _ in p.splits}:
        members: dict[tuple, list[int]] = {}
        for idx in range(p.num_subops):
            digits = p.digits(idx)
            key = tuple(None if (k > 0 and p.splits[k - 1][0] == label) else d for k, d in enumerate(digits))
            members.setdefault(key, []).append(p.devices[idx])
        label_groups[label] = tuple(tuple(m) for m in members.values())
    return OpLayouts(list(p.devices), ins, outs, grads, label_groups)


def _fold_partial(lay: Layout) -> Layout:
    """Storage layout for a whole tensor consumed as partial sums: keep it whole on those devices."""
    return Layout(shape=lay.shape, group=lay.group, replicas=lay.replicas * lay.partial, partial=1,
                  splits=lay.splits, blocks=lay.blocks)


def _loss_index(graph: Graph) -> Optional[int]:
    n = len(graph.outputs)
    if graph.out_spec is None:
        return 0 if n == 1 else None
    try:
        structured = pytree.tree_unflatten(list(range(n)), graph.out_spec)
    except Exception:
        return None
    from nnscaler_plugins.outputs import extract_loss
    scalars = [o is not None and graph.values[o].meta is not None and graph.values[o].meta.ndim == 0
               for o in graph.outputs]
    try:
        idx = extract_loss(structured, lambda i: isinstance(i, int) and 0 <= i < n and scalars[i])
    except (TypeError, ValueError):
        return None
    return idx if isinstance(idx, int) else None


def _stages(graph: Graph, plan: Plan) -> tuple[dict[str, int], list[tuple[int, ...]]]:
    """Stage of every op and devices of every stage; a plan without a pipeline is one stage."""
    if plan.pipeline is None:
        return {op.name: 0 for op in graph.ops}, [tuple(range(plan.unit_size))]
    return ({op.name: plan.ops[op.name].stage for op in graph.ops},
            [tuple(g) for g in plan.pipeline.stage_devices])


def lower(graph: Graph, plan: Plan) -> Program:
    """The per-rank, per-stage programs that run `plan` on `graph` (phases: `_Lowering`)."""
    return _Lowering(graph, plan).run()


class _Lowering:
    """`lower`'s phases, run in order by `run`; each reads what the earlier ones left on `self`.

    1. `find_boundaries`: which stage makes each value, which later stages read it (pipeline
       boundaries), which stage returns each model output.
    2. `seed_layouts`: the layouts values enter each stage in (graph inputs, received boundaries).
    3. `place_parameters`: one stored copy of each parameter per pipeline rank using it, its
       storage layout and who sums its gradients; copies on several ranks are tied.
    4. `emit_ops`: per op, in graph order, the input reshards and gradient sums, then each device's
       local call (co-sharded pieces where the plan co-shards it).
    5. `mark_recompute`: statements serving an op of a recompute group join that group; then each
       program that seeds random ops takes its forward's token first (`random_ops`).
    6. `emit_stage_outputs`: what leaves each stage, made whole (boundary values, model outputs).
    7. `overlap_tp_collectives`: collectives next to tensor-parallel matmuls fused with them.
    8. `assemble`: the per-rank, per-stage programs.
    """

    def __init__(self, graph: Graph, plan: Plan):
        self.graph, self.plan = graph, plan
        self.unit = plan.unit_size
        self.stage_of, self.stage_groups = _stages(graph, plan)
        self.num_stages = len(self.stage_groups)
        # pipeline rank of each device group
        self.group_ids = {g: i for i, g in enumerate(dict.fromkeys(self.stage_groups))}
        self.reshards: list[ReshardPlan] = []
        self.reshard_index: dict[tuple, int] = {}
        self.grad_groups: list[tuple[tuple[int, ...], ...]] = []
        self.kernel_groups: list[tuple[tuple[int, ...], ...]] = []
        self.replica_kernels: list[int] = []
        self.kernels = KernelChoices(plan.knobs.cp_comm, plan.knobs.capacity_factor)
        self.random_keys = random_op_keys(graph, plan)  # ops that draw: each piece under its own seed
        self.stmts: dict[tuple[int, int], list[Stmt]] = {(d, k): [] for k, g in enumerate(self.stage_groups)
                                                          for d in g}
        # produced[k][v]: the layout value v has on stage k's devices.
        self.produced: list[dict[str, Layout]] = [dict() for _ in range(self.num_stages)]
        self.counter = 0

    def run(self) -> Program:
        self.find_boundaries()
        self.seed_layouts()
        self.place_parameters()
        self.emit_ops()
        self.mark_recompute()
        add_forward_tokens(self.stmts, Stmt)  # after recompute: the token is taken once
        self.emit_stage_outputs()
        self.overlap_tp_collectives()
        self.fold_key_value_repeats()
        return self.assemble()

    # -- 1. stages and pipeline boundaries ----------------------------------------------------------
    def find_boundaries(self) -> None:
        graph = self.graph
        made_in: dict[str, int] = {}
        read_in: dict[str, list[int]] = {}
        for op in graph.ops:
            k = self.stage_of[op.name]
            for name in op.inputs:
                if name in made_in and made_in[name] != k and k not in read_in.setdefault(name, []):
                    read_in[name].append(k)
            for o in op.outputs:
                if o is not None:
                    made_in[o] = k
        self.boundaries = [Boundary(v, made_in[v], tuple(sorted(ks)), graph.meta(v).requires_grad)
                           for v, ks in read_in.items() if ks]
        self.output_stage: list[Optional[int]] = [made_in.get(o) if o is not None else None for o in graph.outputs]
        for oi, (o, k) in enumerate(zip(graph.outputs, self.output_stage)):
            if o is not None and k is None:  # an input or parameter returned as is: the last stage returns it
                self.output_stage[oi] = self.num_stages - 1

    # -- 2. layouts values enter the stages in ---------------------------------------------------------
    def seed_layouts(self) -> None:
        graph, full_group = self.graph, tuple(range(self.unit))
        for inp in graph.inputs:
            if graph.values[inp.name].meta is not None:
                for k in range(self.num_stages):
                    self.produced[k][inp.name] = Layout.replicated(graph.meta(inp.name).shape, full_group)
        for b in self.boundaries:
            for k in b.dsts:
                self.produced[k][b.value] = Layout.replicated(graph.meta(b.value).shape, self.stage_groups[k])

    # -- 3. parameter storage and tied copies ----------------------------------------------------------
    def place_parameters(self) -> None:
        """One stored copy per pipeline rank that uses a parameter; its consumers decide the storage
        layout and who sums the gradients."""
        graph, plan = self.graph, self.plan
        self.op_info: dict[str, tuple[Signature, OpLayouts]] = {}
        uses: dict[tuple[str, int], list[tuple[OpNode, int]]] = {}
        for op in graph.ops:
            sig = signature_for(graph, op)
            lays = op_layouts(graph, op, plan.ops[op.name].unit_view(), sig)
            self.op_info[op.name] = (sig, lays)
            rank = self.group_ids[self.stage_groups[self.stage_of[op.name]]]
            for i, name in enumerate(op.inputs):
                if graph.values[name].kind in ("param", "buffer", "constant"):
                    uses.setdefault((name, rank), []).append((op, i))
        ranks_using: dict[str, list[int]] = {}
        for name, rank in uses:
            ranks_using.setdefault(name, []).append(rank)
        self.shards: dict[str, ParamShard] = {}
        self.shard_key: dict[tuple[str, int], str] = {}
        self.reducer_owned: set[tuple[str, str, int]] = set()
        for (name, rank), us in uses.items():
            v = graph.values[name]
            key = name if len(ranks_using[name]) == 1 else f"{name}__r{rank}"
            self.shard_key[(name, rank)] = key
            first_op, first_i = us[0]
            storage = _fold_partial(self.op_info[first_op.name][1].inputs[first_i])
            gg_all = {self.op_info[o.name][1].grad_partial[i] for o, i in us}
            use_reducer = v.kind == "param" and v.meta.requires_grad and len(gg_all) == 1
            gg = next(iter(gg_all)) if use_reducer else ()
            if use_reducer:
                self.reducer_owned |= {(name, o.name, i) for o, i in us}
            self.shards[key] = ParamShard(name, v.fqn or name, v.aliases, v.kind, storage, gg, v.persistent, gg)
            for k, g in enumerate(self.stage_groups):
                if self.group_ids[g] == rank:
                    self.produced[k][name] = storage
        _tie_copies(graph, self.shards, ranks_using, self.shard_key)

    # -- helpers: fresh names and layout changes ---------------------------------------------------------
    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}__{self.counter}"

    def get_reshard(self, src: Layout, dst: Layout, what: str) -> int:
        k = (src, dst)
        if k not in self.reshard_index:
            whole_on_superset = src.replicas == len(src.group) and set(dst.group) <= set(src.group)
            if set(src.group) != set(dst.group) and not whole_on_superset:
                raise PlanError(f"{what}: produced on devices {sorted(set(src.group))} but used on "
                                f"{sorted(set(dst.group))}; moving tensors between device sets needs a pipeline "
                                "plan (op-order), place producer and consumer on the same devices")
            if set(src.group) != set(dst.group):
                src = Layout.replicated(src.shape, dst.group)
            self.reshard_index[k] = len(self.reshards)
            self.reshards.append(plan_reshard(src, dst))
        return self.reshard_index[k]

    def reshard_to(self, k: int, name: str, src: Layout, dst: Layout, what: str, op: Optional[OpNode] = None,
                   output_of: Optional[int] = None) -> str:
        """Emit the change of layout on stage k's devices; the variable holding the result."""
        if src == dst:
            return name
        r = self.get_reshard(src, dst, what)
        if self.reshards[r].is_identity:
            return name
        var = self.fresh(name if output_of is None else name + "_out")
        for dev in sorted(set(dst.group) | (set(src.group) & set(self.stage_groups[k]))):
            self.stmts[(dev, k)].append(Stmt("reshard", out=[var], src=name, key=r, op=op,
                                             comment=_describe(self.reshards[r]), output_of=output_of))
        return var

    # -- 4. per-op statements --------------------------------------------------------------------------
    def emit_ops(self) -> None:
        """Statements in graph order; every device of a stage walks the same order (no deadlock)."""
        self.input_vars: dict[tuple[int, str, Layout, tuple], str] = {}
        for op in self.graph.ops:
            local_names = self.emit_inputs(op)
            k = self.stage_of[op.name]
            lays = self.op_info[op.name][1]
            for j, name in enumerate(op.outputs):
                if name is not None:
                    self.produced[k][name] = lays.outputs[j]
            self.emit_local_calls(op, local_names)

    def emit_inputs(self, op: OpNode) -> list[str]:
        """Each input in the layout the op's pieces read, its gradient summed where it comes out partial;
        the variables holding them (shared by every consumer wanting the same)."""
        graph = self.graph
        k = self.stage_of[op.name]
        lays = self.op_info[op.name][1]
        local_names: list[str] = []
        for i, name in enumerate(op.inputs):
            src = self.produced[k].get(name)
            if src is None:
                raise PlanError(f"input {name} has no producer before this op", op=op.name, where=op.where())
            dst = lays.inputs[i]
            need_grad = graph.meta(name).requires_grad and op.grad_enabled
            gg = lays.grad_partial[i] if need_grad and (name, op.name, i) not in self.reducer_owned else ()
            key = (k, name, dst, gg)
            if key not in self.input_vars:
                var = self.reshard_to(k, name, src, dst, f"{name} consumed by {op.where()}", op)
                if gg:
                    var = self.emit_grad_sum(k, op, var, name, gg)
                self.input_vars[key] = var
            local_names.append(self.input_vars[key])
        return local_names

    def emit_grad_sum(self, k: int, op: OpNode, var: str, name: str, gg: tuple[tuple[int, ...], ...]) -> str:
        gk = len(self.grad_groups)
        self.grad_groups.append(gg)
        new = self.fresh(name + "_g")
        for dev in sorted({d for g in gg for d in g}):
            self.stmts[(dev, k)].append(Stmt("grad_sum", out=[new], src=var, key=gk, op=op,
                                             comment=f"sum gradient over {list(gg)} in backward"))
        return new

    def emit_local_calls(self, op: OpNode, local_names: list[str]) -> None:
        """What each device of the op runs: its piece, localized, reading the input variables."""
        graph = self.graph
        k = self.stage_of[op.name]
        sig, lays = self.op_info[op.name]
        p = self.plan.ops[op.name]
        call = op_call(graph, op)
        renames = dict(zip(op.inputs, local_names))
        unit_p = p.unit_view()
        random_key = self.random_keys.get(op.name)
        for idx, dev in enumerate(lays.devices):
            local = _localize(graph, op, sig, call, unit_p, idx, lays, self.kernels)
            args, kwargs = _rename(local.args, local.kwargs, renames)
            gkw = None
            if local.group_label is not None:
                gkw = len(self.kernel_groups)
                self.kernel_groups.append(lays.label_groups[local.group_label])
            cs = _coshard_call(graph, op, sig, call, p, idx, renames, local_names) if p.coshard > 1 else None
            st = Stmt("op", out=list(op.outputs), target=local.target, args=args, kwargs=kwargs, op=op,
                      grad_enabled=op.grad_enabled, group_kwarg=gkw, coshard=cs)
            if random_key is not None:
                seed_piece(st, op, random_key, unit_p, idx)
            self.stmts[(dev, k)].append(st)
        self.emit_replica_statistic(op, local_names)

    def emit_replica_statistic(self, op: OpNode, local_names: list[str]) -> None:
        """A reduction over the batch that the loss uses nonlinearly (the plan's `batch_statistics`,
        found by the strategy) made whole across the data-parallel replicas right after the op
        (`kernels.replica_statistics`); its pieces stay partial sums inside the unit."""
        stats = self.plan.knobs.batch_statistic_ops
        found = stats.get(op.name) if self.plan.knobs.batch_statistics == "global" and self.plan.dp > 1 else None
        if found is None or op.outputs[0] is None:
            return
        how, carrier = found  # "sum" | "mean" | "batch_norm", the input holding the batch's elements
        lays = self.op_info[op.name][1]
        gkw = len(self.kernel_groups)
        self.kernel_groups.append(tuple((d,) for d in lays.devices))
        self.replica_kernels.append(gkw)
        if how == "batch_norm":  # the op itself takes the whole batch's statistics (SyncBatchNorm's kernel)
            k = self.stage_of[op.name]
            for dev in lays.devices:
                st = next(s for s in reversed(self.stmts[(dev, k)]) if s.kind == "op" and s.op is op)
                st.target, st.group_kwarg = BATCH_NORM_KERNELS[op.op_name], gkw
                if st.coshard is not None:  # channel chunks one after another: each over the whole batch
                    st.coshard.pieces = [(st.target, a, kw) for _, a, kw in st.coshard.pieces]
                st.comment = "batch norm over the whole batch of every data-parallel replica"
            return
        out = op.outputs[0]
        dims = op.args[1] if op.op_name.endswith((".dim", ".dim_IntList")) and len(op.args) > 1 else ()
        dims = tuple([dims] if isinstance(dims, int) else dims or ())
        args = (Ref(out), Ref(local_names[carrier]), dims if carrier == 0 else ())
        for dev in lays.devices:
            self.stmts[(dev, self.stage_of[op.name])].append(
                Stmt("op", out=[out], target=across_replicas, args=args, kwargs={"mean": how == "mean"}, op=op,
                     grad_enabled=op.grad_enabled, group_kwarg=gkw,
                     comment="batch statistic made whole across the data-parallel replicas"))

    # -- 5. recompute groups -------------------------------------------------------------------------------
    def mark_recompute(self) -> None:
        for per_device in self.stmts.values():
            for st in per_device:
                if st.op is not None and st.output_of is None:
                    st.recompute = self.plan.ops[st.op.name].recompute

    # -- 6. what leaves each stage ----------------------------------------------------------------------
    def emit_stage_outputs(self) -> None:
        """Boundary values, then the model's outputs, made whole on their stage's devices."""
        graph = self.graph
        self.sent_vars: dict[tuple[int, str], str] = {}
        self.stage_sends: list[list[str]] = [[] for _ in range(self.num_stages)]
        for b in self.boundaries:
            g = self.stage_groups[b.src]
            var = self.reshard_to(b.src, b.value, self.produced[b.src][b.value],
                                  Layout.replicated(graph.meta(b.value).shape, g), f"{b.value} sent from stage {b.src}")
            self.sent_vars[(b.src, b.value)] = var
            self.stage_sends[b.src].append(b.value)
        self.out_vars: dict[tuple[int, int], Optional[str]] = {}
        for oi, o in enumerate(graph.outputs):
            k = self.output_stage[oi]
            if o is None:
                continue
            g = self.stage_groups[k]
            self.out_vars[(k, oi)] = self.reshard_to(k, o, self.produced[k][o],
                                                     Layout.replicated(graph.meta(o).shape, g), f"model output {o}",
                                                     output_of=oi)

    # -- 7. tensor-parallel collectives fused with their matmuls ----------------------------------------
    def overlap_tp_collectives(self) -> None:
        """Collectives next to tensor-parallel matmuls become kernels that pipeline them
        (lower/tp_overlap.py), and experts layers run around independent compute
        (lower/expert_overlap.py), unless the plan says tp_comm_overlap=False."""
        returned = {v for v in self.sent_vars.values()} | {v for v in self.out_vars.values() if v is not None}

        def tables(k: int, stmts: list[Stmt]) -> tp_overlap.Tables:
            shapes = self.local_shapes(k, stmts)
            # a fp8 plan's float8 linears keep their own kernel (codegen calls kernels/float8.py for them)
            keep = frozenset(float8_linears(self.graph, self.plan.knobs, shapes)) \
                if self.plan.precision == "fp8" else frozenset()
            return tp_overlap.Tables(self.reshards, self.grad_groups, self.kernel_groups, shapes.get,
                                     self.plan.knobs.tp_comm_overlap, keep)

        self.stmts = tp_overlap.fuse_program(self.stmts, returned, tables)
        self.stmts = expert_overlap.overlap_experts(self.stmts, self.plan.knobs.tp_comm_overlap is not False)

    # -- 8. grouped-query attention without key/value copies --------------------------------------------
    def fold_key_value_repeats(self) -> None:
        """Key/value heads repeated for grouped-query attention are read in place by the attention
        call (`enable_gqa`; lower/grouped_query.py)."""
        returned = {v for v in self.sent_vars.values()} | {v for v in self.out_vars.values() if v is not None}
        self.stmts = grouped_query.fold_program(self.stmts, returned)

    def local_shapes(self, k: int, stmts: list[Stmt]) -> dict[str, tuple[int, ...]]:
        """Each value's shape on one device of stage k (what its statements make, and what enters it)."""
        out = {name: tuple(lay.local_shape()) for name, lay in self.produced[k].items()
               if name in self.graph.values and self.graph.values[name].kind != "op"}
        for st in stmts:
            if st.kind == "reshard":
                out[st.out[0]] = tuple(self.reshards[st.key].dst.local_shape())
            elif st.kind == "grad_sum" and st.src in out:
                out[st.out[0]] = out[st.src]
            elif st.kind == "op" and st.op is not None and st.op.name in self.op_info:
                lays = self.op_info[st.op.name][1].outputs
                for j, o in enumerate(st.out):
                    if o and j < len(lays) and lays[j] is not None and o == st.op.outputs[j]:
                        out[o] = tuple(lays[j].local_shape())
        return out

    # -- 8. per-rank programs --------------------------------------------------------------------------
    def stage_inputs(self) -> list[list[str]]:
        """Per stage: the graph inputs it reads (every input without a pipeline), then the boundary
        values it receives."""
        graph, num_stages = self.graph, self.num_stages
        used_inputs = [[i.name for i in graph.inputs
                        if any(i.name in op.inputs for op in graph.ops if self.stage_of[op.name] == k)
                        or (i.name in graph.outputs and self.output_stage[graph.outputs.index(i.name)] == k)]
                       for k in range(num_stages)]
        if num_stages == 1:
            used_inputs = [[i.name for i in graph.inputs]]  # the whole model takes every input
        return [used_inputs[k] + [b.value for b in self.boundaries if k in b.dsts] for k in range(num_stages)]

    def assemble(self) -> Program:
        graph = self.graph
        stage_inputs = self.stage_inputs()
        key_rank = {key: rank for (_name, rank), key in self.shard_key.items()}
        ranks = []
        for dev in range(self.unit):
            held = [key for key, sh in self.shards.items() if dev in sh.layout.group]
            per_stage = {}
            for k, g in enumerate(self.stage_groups):
                if dev not in g:
                    continue
                mine = [key for key in held if key_rank[key] == self.group_ids[g]]
                per_stage[k] = StageProgram(k, dev, self.stmts[(dev, k)], stage_inputs[k],
                                            [self.sent_vars[(k, v)] for v in self.stage_sends[k]],
                                            [self.out_vars.get((k, oi)) for oi in range(len(graph.outputs))], mine)
            ranks.append(RankProgram(dev, per_stage, held))
        return Program(graph, self.plan, self.unit, ranks, self.shards, self.reshards, self.grad_groups,
                       self.kernel_groups, _loss_index(graph), self.stage_groups, self.boundaries, stage_inputs,
                       self.stage_sends, self.output_stage, self.replica_kernels)


def _tie_copies(graph: Graph, shards: dict[str, ParamShard], ranks_using: dict[str, list[int]],
                shard_key: dict[tuple[str, int], str]) -> None:
    """Copies of one parameter on several pipeline ranks (tied weights) step together: their
    gradients are summed across the copies, piece by piece, by the reducer."""
    for name, ranks in ranks_using.items():
        if len(ranks) < 2:
            continue
        copies = [shards[shard_key[(name, r)]] for r in ranks]
        first = copies[0]
        if first.kind != "param" or not graph.meta(name).requires_grad:
            continue
        shape = (first.layout.replicas, first.layout.partial, first.layout.splits, first.layout.blocks)
        for c in copies[1:]:
            other = (c.layout.replicas, c.layout.partial, c.layout.splits, c.layout.blocks)
            if other != shape or _positions(c.layout, c.reduce_groups) != _positions(first.layout, first.reduce_groups):
                raise PlanError(f"parameter {first.fqn} is used by several pipeline stages and split differently on "
                                f"them ({first.layout} vs {c.layout}); split it the same way wherever it is used")
        joined = []
        for positions in _positions(first.layout, first.reduce_groups):
            joined.append(tuple(sorted(c.layout.group[pos] for c in copies for pos in positions)))
        for c in copies:
            c.reduce_groups = tuple(joined)
            c.tied = True


def _positions(layout: Layout, groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    """Groups as positions in the layout (device-independent), every position in one group."""
    out, covered = [], set()
    for g in groups:
        pos = tuple(sorted(layout.position_of(d) for d in g))
        out.append(pos)
        covered |= set(pos)
    out += [(p,) for p in range(layout.num_devices) if p not in covered]
    return sorted(out)


def _coshard_call(graph: Graph, op: OpNode, sig: Signature, call, p: OpPlacement, idx: int,
                  renames: dict[str, str], local_names: list[str]) -> CoShardCall:
    """The pieces device `idx` of a co-sharded op runs, localized for the finer split."""
    c = p.coshard
    label = p.splits[-1][0]
    numbered = OpPlacement(p.splits, p.replicate, list(range(p.num_subops)), p.blocks, p.stage)
    lays = op_layouts(graph, op, numbered, sig)
    pieces = []
    for j in range(c):
        local = _localize(graph, op, sig, call, p, idx * c + j, lays)
        if local.group_label is not None:
            raise PlanError(f"cannot be co-sharded: its pieces along {label!r} talk to each other through a "
                            "process group; co-shard the ops around it instead", op=op.name, where=op.where())
        args, kwargs = _rename(local.args, local.kwargs, renames)
        pieces.append((local.target, args, kwargs))

    def block_of(labels, input_index):
        b = sig.blocks.get((label, input_index), p.blocks.get(label, 1)) if input_index is not None else \
            p.blocks.get(label, 1)
        return b

    in_modes: list[tuple] = []
    for i, labels in enumerate(sig.inputs):
        dims = [d for d, l in enumerate(labels or ()) if l == label]
        host = merged_host(sig, label, labels)
        if host is not None:
            in_modes.append(("chunk", (host[0],), host[1] * block_of(labels, i)))
        elif dims:
            in_modes.append(("chunk", tuple(dims), block_of(labels, i)))
        elif i in sig.partial_inputs.get(label, frozenset()):
            in_modes.append(("first",))
        else:
            in_modes.append(("whole",))
    out_modes: list[Optional[tuple]] = []
    for j, name in enumerate(op.outputs):
        labels = sig.outputs[j] if j < len(sig.outputs) else None
        dims = [d for d, l in enumerate(labels or ()) if l == label]
        host = merged_host(sig, label, labels)
        if name is None:
            out_modes.append(None)
        elif host is not None:
            out_modes.append(("cat", host[0], host[1] * block_of(labels, None)))
        elif len(dims) > 1:
            raise PlanError(f"cannot be co-sharded along {label!r}: output {j} carries it on several dims", op=op.name,
                            where=op.where())
        elif dims:
            out_modes.append(("cat", dims[0], block_of(labels, None)))
        elif label in sig.reduce:
            out_modes.append(("sum",))
        else:
            out_modes.append(("first",))
    return CoShardCall(c, pieces, in_modes, out_modes, list(local_names))


def _describe(rp: ReshardPlan) -> str:
    try:
        return "; ".join(s.describe() for s in rp.steps)
    except Exception:
        return "reshard"


def _local_meta(meta: Optional[TensorMeta], lay: Optional[Layout]) -> Optional[TensorMeta]:
    if meta is None or lay is None:
        return meta
    return TensorMeta(tuple(lay.local_shape()), meta.dtype, meta.requires_grad)


def _localize(graph: Graph, op: OpNode, sig: Signature, call, p: OpPlacement, idx: int,
              lays: OpLayouts, kernels: Optional[KernelChoices] = None) -> Localized:
    if not p.splits or sig.localize is None:
        return Localized(op.target, op.args, op.kwargs)
    lc = LocalCall(call=call, splits=p.label_counts(), index=p.label_index(idx),
                   local_inputs=tuple(_local_meta(m, l) for m, l in zip(call.inputs, lays.inputs)),
                   local_outputs=tuple(_local_meta(m, l) for m, l in zip(call.outputs, lays.outputs)),
                   blocks=dict(p.blocks), kernels=kernels or KernelChoices())
    return sig.localize(lc)


def _rename(args: tuple, kwargs: dict, names: dict[str, str]) -> tuple[tuple, dict]:
    def f(x: Any) -> Any:
        if isinstance(x, Ref) and x.name in names:
            return Ref(names[x.name])
        return x
    return pytree.tree_map(f, args), pytree.tree_map(f, kwargs)
