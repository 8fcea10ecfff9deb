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

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.utils._pytree as pytree

from .errors import PlanError
from .graph import Graph, OpNode, Ref, TensorMeta
from .layout import Layout
from .plan import OpPlacement, Plan
from .resharding import ReshardPlan
from .resharding import plan as plan_reshard
from .rules import LocalCall, Localized, Signature, op_call, signature_for


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


@dataclass
class ParamShard:
    value: str
    fqn: str
    aliases: tuple[str, ...]
    kind: str  # "param" | "buffer" | "constant"
    layout: Layout
    grad_groups: tuple[tuple[int, ...], ...] = ()  # unit device groups to sum gradients over
    persistent: bool = True  # part of the model's state dict (non-persistent buffers are not)

    @property
    def in_state_dict(self) -> bool:
        return self.kind == "param" or (self.kind == "buffer" and self.persistent)


@dataclass
class RankProgram:
    device: int
    stmts: list[Stmt]
    inputs: list[str]  # graph input value names this rank receives (all of them)
    outputs: list[Optional[str]]  # var per flattened model output (None: constant)
    params: list[str]  # param/buffer values held on this rank


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

    def collective_counts(self, device: int = 0):
        """Collectives this device runs in one forward (by kind), for tests and explain()."""
        from collections import Counter
        c: Counter = Counter()
        for s in self.ranks[device].stmts:
            if s.kind == "reshard":
                c.update(self.reshards[s.key].count())
            elif s.kind == "op" and s.group_kwarg is not None:
                c["kernel:" + getattr(s.target, "__name__", str(s.target))] += 1
        return c


# ---------------------------------------------------------------------------------------------------
def _digit_kinds(sig: Signature, p: OpPlacement, labels: Optional[tuple[str, ...]], is_output: bool,
                 input_index: int) -> list[tuple[str, Any]]:
    """For one tensor, what each sub-op digit means for it: ('R', compute?) | ('V',) | ('D', dim)."""
    kinds: list[tuple[str, Any]] = [("R", "compute")]
    for label, _n in p.splits:
        if labels is not None and label in labels:
            kinds.append(("D", labels.index(label)))
        elif is_output and label in sig.reduce:
            kinds.append(("V", None))
        elif not is_output and input_index in sig.partial_inputs.get(label, frozenset()):
            kinds.append(("V", None))
        else:
            kinds.append(("R", "partition"))
    return kinds


def _layout_for(meta: TensorMeta, p: OpPlacement, kinds: list[tuple[str, Any]],
                blocks: dict[int, int]) -> tuple[Layout, tuple[tuple[int, ...], ...]]:
    radices = [p.replicate] + [n for _, n in p.splits]
    ndim = meta.ndim
    R = math.prod(r for r, k in zip(radices, kinds) if k[0] == "R")
    V = math.prod(r for r, k in zip(radices, kinds) if k[0] == "V")
    splits = [1] * ndim
    for r, k in zip(radices, kinds):
        if k[0] == "D":
            splits[k[1]] *= r
    group: list[Optional[int]] = [None] * p.num_subops
    partition_members: dict[tuple, list[int]] = {}
    for idx in range(p.num_subops):
        digits = p.digits(idx)
        r = v = 0
        dpos = [0] * ndim
        key = []
        for dig, rad, k in zip(digits, radices, kinds):
            if k[0] == "R":
                r = r * rad + dig
            elif k[0] == "V":
                v = v * rad + dig
            else:
                dpos[k[1]] = dpos[k[1]] * rad + dig
            key.append(None if (k[0] == "R" and k[1] == "partition") else dig)
        pos = r * V + v
        for dd in range(ndim):
            pos = pos * splits[dd] + dpos[dd]
        group[pos] = p.devices[idx]
        partition_members.setdefault(tuple(key), []).append(p.devices[idx])
    has_partition = any(k == ("R", "partition") for k in kinds)
    grad_groups = tuple(sorted(tuple(sorted(g)) for g in partition_members.values())) if has_partition else ()
    layout = Layout(shape=tuple(meta.shape), group=tuple(group), replicas=R, partial=V, splits=tuple(splits),
                    blocks=tuple(blocks.get(d, 1) for d in range(ndim)))
    return layout, grad_groups


def op_layouts(graph: Graph, op: OpNode, p: OpPlacement, sig: Signature) -> OpLayouts:
    blocks_map = getattr(sig, "blocks", None) or {}
    ins: list[Optional[Layout]] = []
    grads: list[tuple[tuple[int, ...], ...]] = []
    split_labels = {l for l, _ in p.splits}

    def dim_blocks(labels: Optional[tuple[str, ...]], index: Optional[int]) -> dict[int, int]:
        """Block factor per split dim of one tensor: the rule's for its inputs, else the plan's."""
        out: dict[int, int] = {}
        for d, label in enumerate(labels or ()):
            if label not in split_labels:
                continue
            b = blocks_map.get((label, index), p.blocks.get(label, 1)) if index is not None else p.blocks.get(label, 1)
            if b > 1:
                out[d] = b
        return out

    for i, name in enumerate(op.inputs):
        labels = sig.inputs[i]
        kinds = _digit_kinds(sig, p, labels, False, i)
        lay, gg = _layout_for(graph.meta(name), p, kinds, dim_blocks(labels, i))
        ins.append(lay)
        grads.append(gg)
    outs: list[Optional[Layout]] = []
    for j, name in enumerate(op.outputs):
        if name is None:
            outs.append(None)
            continue
        labels = sig.outputs[j] if j < len(sig.outputs) else None
        kinds = _digit_kinds(sig, p, labels, True, j)
        lay, _ = _layout_for(graph.meta(name), p, kinds, dim_blocks(labels, None))
        outs.append(lay)
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
    from .runtime.loss import extract_loss
    try:
        idx = extract_loss(structured)
    except (TypeError, ValueError):
        return None
    return idx if isinstance(idx, int) else None


def lower(graph: Graph, plan: Plan) -> Program:
    unit = plan.unit_size
    full_group = tuple(range(unit))
    produced: dict[str, Layout] = {}
    shards: dict[str, ParamShard] = {}
    reshards: list[ReshardPlan] = []
    reshard_index: dict[tuple, int] = {}
    grad_groups: list[tuple[tuple[int, ...], ...]] = []
    kernel_groups: list[tuple[tuple[int, ...], ...]] = []
    per_rank: list[list[Stmt]] = [[] for _ in range(unit)]

    for inp in graph.inputs:
        if graph.values[inp.name].meta is not None:
            produced[inp.name] = Layout.replicated(graph.meta(inp.name).shape, full_group)

    # Parameter consumers decide storage and gradient handling up front.
    op_info: dict[str, tuple[Signature, OpLayouts]] = {}
    uses: dict[str, list[tuple[OpNode, int]]] = {}
    for op in graph.ops:
        sig = signature_for(graph, op)
        lays = op_layouts(graph, op, plan.ops[op.name], sig)
        op_info[op.name] = (sig, lays)
        for i, name in enumerate(op.inputs):
            if graph.values[name].kind in ("param", "buffer", "constant"):
                uses.setdefault(name, []).append((op, i))
    reducer_owned: set[tuple[str, str, int]] = set()
    for name, us in uses.items():
        v = graph.values[name]
        first_op, first_i = us[0]
        storage = _fold_partial(op_info[first_op.name][1].inputs[first_i])
        gg_all = {op_info[o.name][1].grad_partial[i] for o, i in us}
        use_reducer = v.kind == "param" and v.meta.requires_grad and len(gg_all) == 1
        gg = next(iter(gg_all)) if use_reducer else ()
        if use_reducer:
            reducer_owned |= {(name, o.name, i) for o, i in us}
        shards[name] = ParamShard(name, v.fqn or name, v.aliases, v.kind, storage, gg, v.persistent)
        produced[name] = storage

    # Statements, in graph order; every rank walks the same order (no deadlock by construction).
    cache: dict[tuple[str, Layout, tuple], str] = {}
    counter = [0]

    def fresh(base: str) -> str:
        counter[0] += 1
        return f"{base}__{counter[0]}"

    def get_reshard(src: Layout, dst: Layout, what: str) -> int:
        k = (src, dst)
        if k not in reshard_index:
            if set(src.group) != set(dst.group) and not (src.replicas == len(src.group) and set(dst.group) <= set(src.group)):
                raise PlanError(f"{what}: produced on devices {sorted(set(src.group))} but used on "
                                f"{sorted(set(dst.group))}; moving tensors between device sets needs a pipeline "
                                "plan (op-order), place producer and consumer on the same devices")
            if set(src.group) != set(dst.group):
                src = Layout.replicated(src.shape, dst.group)
            reshard_index[k] = len(reshards)
            reshards.append(plan_reshard(src, dst))
        return reshard_index[k]

    for op in graph.ops:
        sig, lays = op_info[op.name]
        p = plan.ops[op.name]
        call = op_call(graph, op)
        local_names: list[list[str]] = [[] for _ in range(unit)]
        for i, name in enumerate(op.inputs):
            src = produced.get(name)
            if src is None:
                raise PlanError(f"input {name} has no producer before this op", op=op.name, where=op.where())
            dst = lays.inputs[i]
            need_grad = graph.meta(name).requires_grad and op.grad_enabled
            gg = lays.grad_partial[i] if need_grad and (name, op.name, i) not in reducer_owned else ()
            key = (name, dst, gg)
            if key not in cache:
                var = name
                if src != dst:
                    k = get_reshard(src, dst, f"{name} consumed by {op.where()}")
                    rp = reshards[k]
                    if not rp.is_identity:
                        var = fresh(name)
                        for dev in sorted(set(src.group) | set(dst.group)):
                            per_rank[dev].append(Stmt("reshard", out=[var], src=name, key=k, op=op,
                                                      comment=_describe(rp)))
                if gg:
                    gk = len(grad_groups)
                    grad_groups.append(gg)
                    new = fresh(name + "_g")
                    for dev in sorted({d for g in gg for d in g}):
                        per_rank[dev].append(Stmt("grad_sum", out=[new], src=var, key=gk, op=op,
                                                  comment=f"sum gradient over {list(gg)} in backward"))
                    var = new
                cache[key] = var
            for dev in range(unit):
                local_names[dev].append(cache[key])
        for j, name in enumerate(op.outputs):
            if name is not None:
                produced[name] = lays.outputs[j]
        for idx, dev in enumerate(lays.devices):
            local = _localize(graph, op, sig, call, p, idx, lays)
            args, kwargs = _rename(local.args, local.kwargs, dict(zip(op.inputs, local_names[dev])))
            gkw = None
            if local.group_label is not None:
                gkw = len(kernel_groups)
                kernel_groups.append(lays.label_groups[local.group_label])
            per_rank[dev].append(Stmt("op", out=list(op.outputs), target=local.target, args=args, kwargs=kwargs,
                                      op=op, grad_enabled=op.grad_enabled, group_kwarg=gkw))

    # Outputs are returned whole (replicated) on every device of the unit.
    outputs_per_rank: list[list[Optional[str]]] = [[] for _ in range(unit)]
    for oi, o in enumerate(graph.outputs):
        if o is None:
            for dev in range(unit):
                outputs_per_rank[dev].append(None)
            continue
        src = produced[o]
        dst = Layout.replicated(src.shape, full_group)
        var = o
        if src != dst:
            k = get_reshard(src, dst, f"model output {o}")
            if not reshards[k].is_identity:
                var = fresh(o + "_out")
                for dev in range(unit):
                    per_rank[dev].append(Stmt("reshard", out=[var], src=o, key=k, comment=_describe(reshards[k]),
                                              output_of=oi))
        for dev in range(unit):
            outputs_per_rank[dev].append(var)

    ranks = []
    for dev in range(unit):
        held = [n for n, s in shards.items() if dev in s.layout.group]
        ranks.append(RankProgram(dev, per_rank[dev], [i.name for i in graph.inputs], outputs_per_rank[dev], held))
    return Program(graph, plan, unit, ranks, shards, reshards, grad_groups, kernel_groups, _loss_index(graph))


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
              lays: OpLayouts) -> Localized:
    if not p.splits or sig.localize is None:
        return Localized(op.target, op.args, op.kwargs)
    lc = LocalCall(call=call, splits=p.label_counts(), index=p.label_index(idx),
                   local_inputs=tuple(_local_meta(m, l) for m, l in zip(call.inputs, lays.inputs)),
                   local_outputs=tuple(_local_meta(m, l) for m, l in zip(call.outputs, lays.outputs)))
    return sig.localize(lc)


def _rename(args: tuple, kwargs: dict, names: dict[str, str]) -> tuple[tuple, dict]:
    def f(x: Any) -> Any:
        if isinstance(x, Ref) and x.name in names:
            return Ref(names[x.name])
        return x
    return pytree.tree_map(f, args), pytree.tree_map(f, kwargs)
