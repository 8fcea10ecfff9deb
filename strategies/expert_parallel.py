"""Expert parallelism: each MoE layer's experts split `ep` ways, optionally each expert's width `etp` ways.

The unit of `ep x etp` devices runs the dense part of the model as data parallelism inside the unit
(every op split along the batch, its weights whole on each device), and each mixture-of-experts
layer -- captured as one op, `capture/experts.py` -- split along its `t` label: a device keeps its
own tokens and its share of the experts, and the kernel moves the rows to the experts chosen for
them and back by all-to-all. With `etp` (Megatron's expert tensor parallelism), each share of the
experts is further cut along every expert's intermediate width over `etp` consecutive devices
(the op's `f` label): they see the same tokens (gathered from their batch pieces), each computes
a partial sum of their outputs, and the lowering adds the pieces up -- so experts / ep of them and
1/etp of each sit on a device, where a model with few large experts cannot spread them by ep alone. The plan's `dp` copies of the unit are expert-data-parallel: an
expert's gradient is reduced only among the `dp` replicas that hold that expert, a dense weight's
among all `ep * dp` devices (the unit's batch split gives partial sums the lowering reduces inside
the unit). ZeRO (`zero=`) shards what each device holds across its `dp` replicas: expert state
among the replicas of the same experts only.

Why the batch split is found by propagation and not by naming inputs: the batch dim is followed
from the model's inputs through every op's dimension rule (a reshape of [B, S, H] into [B*S, H]
keeps it, a loss reduces over it), so models the strategy was never shown are planned the same way.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.capture.autograd_functions import FunctionTarget
from nnscaler_plugins.kernels.experts_module import ExpertsCall
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.layers import balanced_stages, layer_groups
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder

from .batch_statistics import apply_batch_statistics
from .propagation import TensorParallelPropagation
from .recompute import apply_recompute

EXPERT_LABEL = "t"  # rules/experts_op.py: tokens and experts, split together
WIDTH_LABEL = "f"  # rules/experts_op.py: each expert's intermediate width


def is_experts_op(op: OpHandle) -> bool:
    t = op.node.target
    return isinstance(t, FunctionTarget) and t.cls is ExpertsCall


def expert_tensor_degree(etp: Any) -> int:
    """`etp=` checked: a positive integer (1, the default, keeps every expert whole)."""
    if etp is None:
        return 1
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
        raise PlanError(f"strategy 'ep': etp={etp!r} must be a positive integer (the number of devices each "
                        "expert's intermediate width is split over)")
    return etp


def degrees(world_size: int, ep: Optional[int] = None, dp: Optional[int] = None, tp: Optional[int] = None,
            pp: Optional[int] = None, etp: Optional[int] = None, **_: Any) -> tuple[int, int]:
    """(unit_size, dp) = (ep x etp x pp, the rest); `ep` defaults to world_size / (dp x etp x pp),
    else the world / (etp x pp). With `tp`, the dense part is tensor-parallel in groups of `tp`
    devices and data-parallel across the groups of the ep x etp devices, so tp must divide ep x etp
    (with a pipeline, tp = ep x etp: each stage's dense ops tensor-parallel over its devices)."""
    e = expert_tensor_degree(etp)
    width = None if ep is None else int(ep) * e
    if tp is not None and width is not None and (int(tp) < 1 or width % int(tp)):
        raise PlanError(f"strategy 'ep': tp={tp} must divide ep x etp = {width} (the dense part tensor-parallel in "
                        "groups of tp devices, data-parallel across the groups, over the devices that split the "
                        "experts)")
    if tp is not None and width is not None and pp is not None and int(pp) > 1 and int(tp) != width:
        raise PlanError(f"strategy 'ep': with pp={pp}, tp={tp} must equal ep x etp = {width} (each stage's dense "
                        "ops tensor-parallel over the stage's devices)")
    if ep is None and tp is not None:
        if int(tp) % e:
            raise PlanError(f"strategy 'ep': tp={tp} without ep= must be a multiple of etp={e}")
        ep = int(tp) // e
    pp = int(pp or 1)
    if ep is None:
        ep = world_size // (int(dp) * pp * e) if dp else world_size // (pp * e)
    for name, value in (("ep", ep), ("dp", dp)):
        if value is not None and (int(value) < 1 or world_size % int(value)):
            raise PlanError(f"strategy 'ep': {name}={value} does not divide the world size {world_size}")
    ep = int(ep)
    unit = ep * e * pp
    if ep < 1 or world_size % unit:
        raise PlanError(f"strategy 'ep': ep={ep} x etp={e} x pp={pp} does not divide the world size {world_size}")
    if dp is not None and unit * int(dp) != world_size:
        raise PlanError(f"strategy 'ep': ep={ep} x etp={e} x pp={pp} x dp={dp} = {unit * int(dp)}, but the world "
                        f"size is {world_size}")
    return unit, world_size // unit


def check_experts(builder: PlanBuilder, ep: Optional[int] = None, etp: int = 1) -> list[OpHandle]:
    """The MoE layers of the graph, each checked to split into `ep` shares of experts and each
    expert's width into `etp` slices; refused by name otherwise."""
    ep = builder.unit_size // etp if ep is None else ep
    layers = [op for op in builder.ops if is_experts_op(op)]
    if not layers:
        raise PlanError("strategy 'ep': the model has no recognized mixture-of-experts layers (a module whose "
                        "parameters are stacked along a leading dim of `num_experts`, called with tokens, expert "
                        "ids and routing weights); use 'dp', 'tp' or 'hybrid' for it")
    graph = builder.graph
    for op in layers:
        x, *_, first = [graph.meta(v) for v in op.node.inputs[:4]]
        experts = first.shape[0]
        if experts % ep:
            raise PlanError(f"strategy 'ep': ep={ep} does not divide the {experts} experts of this layer; choose an "
                            f"ep among the divisors of {experts}", op=op.name, where=op.where())
        if x.shape[0] % ep:
            raise PlanError(f"strategy 'ep': the layer's {x.shape[0]} tokens per replica do not split into ep={ep} "
                            "devices; give each data-parallel replica a batch divisible by ep", op=op.name,
                            where=op.where())
        if etp > 1:
            check_width(graph, op, etp)
    return layers


def check_width(graph: Any, op: OpHandle, etp: int) -> None:
    """Refuses, by name, an experts layer whose width cannot be split `etp` ways exactly."""
    sig = op.signature
    if WIDTH_LABEL not in sig.labels():
        raise PlanError(f"strategy 'ep': etp={etp} needs each expert's intermediate width split, and this experts "
                        "module's forward does not add up from slices of its width (probed by "
                        "rules/experts_intermediate.py; e.g. a bias after the down projection, a norm over the width "
                        "or interleaved gate and up rows); use etp=1 (experts whole, split by ep)",
                        op=op.name, where=op.where())
    if not op.splittable(WIDTH_LABEL, etp):
        widths = sorted({graph.meta(op.node.inputs[i]).shape[labels.index(WIDTH_LABEL)]
                         // sig.blocks.get((WIDTH_LABEL, i), 1)
                         for i, labels in enumerate(sig.inputs) if labels and WIDTH_LABEL in labels})
        raise PlanError(f"strategy 'ep': etp={etp} does not divide each expert's intermediate width "
                        f"({', '.join(map(str, widths))}); choose an etp among its divisors",
                        op=op.name, where=op.where())


def mutates_input(op: OpHandle) -> bool:
    """An in-place op (`copy_` into a slice of a fresh buffer, as DeepSeek-V3's attention writes its
    keys). Split along the batch, each piece would update a local chunk of the view while readers of
    the buffer see it whole and unwritten, so the strategy keeps these whole."""
    parts = op.node.op_name.split(".")
    return len(parts) >= 2 and parts[-2].endswith("_") and not parts[-2].startswith("_")


def batch_choices(builder: PlanBuilder, n: Optional[int] = None) -> dict[str, Optional[str]]:
    """For every op, the label carrying the batch dim of its inputs (split `n` ways, default the
    unit's size), or None (whole).

    Layouts are tracked per value as the split dim (None: whole, a partial sum counts as whole).
    The model's inputs are split along dim 0 when it has the first input's batch size.
    """
    n = builder.unit_size if n is None else n
    graph = builder.graph
    inputs = [v for v in graph.values.values() if v.kind == "input" and v.meta is not None and v.meta.ndim >= 1]
    batch = inputs[0].meta.shape[0] if inputs else None
    split_dim: dict[str, Optional[int]] = {v.name: (0 if v.meta.shape[0] == batch else None) for v in inputs}
    choices: dict[str, Optional[str]] = {}
    for op in builder.ops:
        sig = op.signature
        label: Optional[str] = None
        if is_experts_op(op):
            label = EXPERT_LABEL
        elif mutates_input(op):
            pass  # whole: a piece would write into a chunk copy, not into the tensor its views share
        else:
            for i, name in enumerate(op.node.inputs):
                d = split_dim.get(name)
                labs = sig.inputs[i] if i < len(sig.inputs) else None
                if d is None or labs is None or d >= len(labs):
                    continue
                cand = labs[d]
                if not sig.is_frozen(cand) and op.splittable(cand, n):
                    label = cand
                    break
        choices[op.name] = label
        for j, out in enumerate(op.node.outputs):
            if out is None:
                continue
            labs = sig.outputs[j] if j < len(sig.outputs) else None
            split_dim[out] = (labs.index(label) if label is not None and labs and label in labs else None)
    return choices


def expert_parallel(builder: PlanBuilder, **options: Any) -> None:
    """Experts split `ep` ways with their tokens (and `etp` ways along each expert's width);
    everything else split along the batch inside the unit, or tensor-parallel with `tp`."""
    pp = int(options.get("pp") or 1)
    ep = options.get("ep")
    etp = expert_tensor_degree(options.get("etp"))
    if builder.unit_size % (etp * pp):
        raise PlanError(f"strategy 'ep': etp={etp} x pp={pp} does not divide the plan's unit of {builder.unit_size} "
                        "devices")
    if ep is not None and int(ep) * etp * pp != builder.unit_size:
        raise PlanError(f"strategy 'ep': ep={ep} x etp={etp} x pp={pp} but the plan's unit has {builder.unit_size} "
                        "devices")
    ep = builder.unit_size // (etp * pp)
    builder.options["experts_as_one_op"] = True  # a saved plan is re-applied to the same capture
    check_capacity(options.get("capacity_factor"))
    check_experts(builder, ep, etp)
    apply_batch_statistics(builder, "ep", options.get("batch_statistics"))
    if pp > 1:
        pipelined(builder, pp, options.get("schedule") or "1f1b", etp)
        apply_recompute(builder, options.get("recompute"))
        return
    n = builder.unit_size
    if options.get("tp") is not None and n > 1:
        dense_tensor_parallel(builder, int(options["tp"]), etp)
    else:
        for op, label in zip(builder.ops, batch_choices(builder).values()):
            if is_experts_op(op) and n > 1:
                split_experts(builder, op, ep, etp)
            elif label is None or n == 1:
                builder.replicate(op)
            else:
                builder.split(op, [(label, n)])
    apply_recompute(builder, options.get("recompute"))


def split_experts(builder: PlanBuilder, op: OpHandle, ep: int, etp: int, devices: Optional[list[int]] = None) -> None:
    """An experts op cut into ep shares of experts (with their tokens), each over `etp` consecutive
    devices holding a slice of every expert's width: piece (i, j) on devices[i * etp + j]."""
    dims = [(EXPERT_LABEL, ep)] if ep > 1 else []
    if etp > 1:
        dims.append((WIDTH_LABEL, etp))
    if not dims:
        builder.replicate(op, devices=devices)
        return
    builder.split(op, dims, devices)


def check_capacity(capacity_factor: Any) -> None:
    """`capacity_factor=` (Megatron's): each expert takes at most ceil(factor x rows / experts) of a
    device's (token, choice) rows, the rest dropped; None (the default) drops nothing."""
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise PlanError(f"strategy 'ep': capacity_factor={capacity_factor!r} must be a positive number (or None: "
                        "no token dropped)")


def dense_tensor_parallel(builder: PlanBuilder, tp: int, etp: int = 1) -> None:
    """Megatron's "parallel folding" for MoE models: attention and every dense matmul
    tensor-parallel in groups of `tp` consecutive devices (the `tp` strategy's propagation) and
    split along the batch across the unit's ep / tp groups, while each MoE layer is split along
    experts over all the unit's devices. The experts op reads its tokens from the dense part's
    layout (a local slice) and its token-split output is gathered for the next dense op."""
    n = builder.unit_size
    b = n // tp
    choices = TensorParallelPropagation(builder, degree=tp).run() if tp > 1 else {}
    batch = batch_choices(builder, b) if b > 1 else {}
    for op in builder.ops:
        if is_experts_op(op):
            split_experts(builder, op, n // etp, etp)
            continue
        c = choices.get(op.name)
        tl, block = (c.label, c.block) if c is not None else (None, 1)
        bl = batch.get(op.name)
        if bl is not None and (bl == tl or tl in op.signature.comm_labels):
            # the tensor-parallel walk splits this dim, or a group-aware piece (vocabulary-parallel
            # cross-entropy) communicates along its label: pieces copied across the groups
            bl = None
        if tl is None and bl is None:
            builder.replicate(op)
        elif tl is None:  # batch pieces, each copied over its group's tp devices
            builder.op_trans(op, replicate=tp)
            subs = builder.op_trans(op, dim=bl, num=b)
            for i, sub in enumerate(subs):
                builder.op_assign(sub, (i % b) * tp + i // b)
        else:
            if bl is not None:
                builder.op_trans(op, dim=bl, num=b)
            elif b > 1:
                builder.op_trans(op, replicate=b)
            for device, sub in enumerate(builder.op_trans(op, dim=tl, num=tp, block=block)):
                builder.op_assign(sub, device)


def pipelined(builder: PlanBuilder, pp: int, schedule: Any, etp: int = 1) -> None:
    """The layer stack in `pp` stages of ep x etp devices each (as the pipeline strategies cut it);
    inside a stage the dense ops are tensor-parallel over the stage's devices and each MoE layer is
    split along experts (and widths) over them. Values enter and leave a stage whole, as the
    pipeline executor moves them."""
    size = builder.unit_size // pp
    try:
        stages = balanced_stages(layer_groups(builder.graph), pp)
    except ValueError as e:
        raise PlanError(f"strategy 'ep': cannot cut {builder.graph.model_class} into {pp} pipeline stages: {e}") \
            from None
    handles = {op.name: op for op in builder.ops}
    stage_devices = [list(range(r * size, (r + 1) * size)) for r in range(pp)]
    for ops, devices in zip(stages, stage_devices):
        segment = [handles[op.name] for op in ops]
        choices = TensorParallelPropagation(builder, degree=size, devices_of=lambda op, d=devices: d,
                                            ops=segment).run() if size > 1 else {}
        for op in segment:
            c = choices.get(op.name)
            if is_experts_op(op):
                split_experts(builder, op, size // etp, etp, devices)
                continue
            label = c.label if c is not None else None
            if label is None:
                builder.replicate(op, devices=devices)
                continue
            block = c.block if c is not None and label == c.label else 1
            for device, sub in zip(devices, builder.op_trans(op, dim=label, num=size, block=block)):
                builder.op_assign(sub, device)
    builder.op_order([[op.name for op in ops] for ops in stages], stage_devices, schedule=schedule)


# Read by the entry points before capture (capture/experts.py: wants_experts_as_one_op).
expert_parallel.experts_as_one_op = True  # type: ignore[attr-defined]
