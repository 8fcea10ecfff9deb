"""Plan validation: everything that can be known wrong before a process starts."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.rules import op_call, signature_for

if TYPE_CHECKING:  # for annotations only: plan.py calls this module, not the other way round
    from nnscaler_plugins.plan.plan import Plan


def made_for(plan: Plan, graph: Graph) -> bool:
    """Whether `plan` was made for `graph`: the same graph, or the same model at other input sizes
    (plans that carry a size-free fingerprint serve any sizes)."""
    return plan.graph_fingerprint == graph.fingerprint() or (
        bool(plan.structure_fingerprint) and plan.structure_fingerprint == graph.structure_fingerprint())


def validate(plan: Plan, graph: Graph, world_size: Optional[int] = None) -> None:
    """Raise PlanError for the first problem found, naming the op and its source line."""
    if not made_for(plan, graph):
        shapes = {i.path[1] if len(i.path) == 2 else ".".join(map(str, i.path[1:])): list(graph.meta(i.name).shape)
                  for i in graph.inputs if graph.values[i.name].meta is not None}
        # Plans that carry a size-free fingerprint serve any input sizes: for them a mismatch is the
        # model's, not the batch's. Older plans were made for their inputs' shapes alone.
        if plan.input_shapes and plan.input_shapes != shapes and not plan.structure_fingerprint:
            raise PlanError(
                f"plan was made for inputs {plan.input_shapes} (one micro-batch of one data-parallel replica), "
                f"but the model is given {shapes}; give each replica the batch the plan expects "
                f"({plan.num_micro_batches} micro-batch(es) of that size), or make a new plan for these shapes")
        known = set(plan.ops)
        missing = [op.name for op in graph.ops if op.name not in known][:5]
        extra = [n for n in plan.ops if n not in {op.name for op in graph.ops}][:5]
        detail = ""
        if missing or extra:
            detail = f" (ops only in the graph: {missing}; only in the plan: {extra})"
        if graph.traced.startswith("whole:"):  # its repeated layers could not be traced two deep, and why
            detail += f"; this capture traced its layers {graph.traced}"
        raise PlanError(
            f"plan was made for another graph: plan fingerprint {plan.graph_fingerprint} ({plan.model_class}), "
            f"this graph {graph.fingerprint()} ({graph.model_class}){detail}. The model code"
            + (" or its config changed" if plan.structure_fingerprint else ", its config or the example input shapes "
               "changed") + "; make a new plan (nns.plan) for this model.")
    names = {op.name for op in graph.ops}
    unknown = [n for n in plan.ops if n not in names]
    if unknown:
        import difflib

        hints = []
        for n in unknown[:5]:
            close = difflib.get_close_matches(n, sorted(names), n=1)
            hints.append(f"{n!r}" + (f" (closest op: {close[0]!r})" if close else ""))
        raise PlanError(f"the plan places op(s) the model does not have: {', '.join(hints)}"
                        f"{' and more' if len(unknown) > 5 else ''}. Edit the plan file or make a new plan "
                        "(nns.plan) for this model")
    if world_size is not None and world_size != plan.world_size:
        raise PlanError(f"plan is for world size {plan.world_size} ({plan.dp} x {plan.unit_size}) but the job "
                        f"has {world_size} processes; make a plan for {world_size} or launch {plan.world_size}")
    if plan.unit_size < 1 or plan.dp < 1:
        raise PlanError(f"invalid degrees: unit size {plan.unit_size}, dp {plan.dp}")
    if plan.pipeline is not None:
        _validate_pipeline(plan, graph)
    else:
        staged = next((op for op in graph.ops if op.name in plan.ops and plan.ops[op.name].stage is not None), None)
        if staged is not None:
            raise PlanError("has a pipeline stage but the plan has no pipeline (op_order)", op=staged.name,
                            where=staged.where())
    for op in graph.ops:
        p = plan.ops.get(op.name)
        if p is None:
            raise PlanError("has no placement in the plan (every op needs op_trans/op_assign or replicate)",
                            op=op.name, where=op.where())
        if len(p.devices) != p.num_subops:
            raise PlanError(f"plan lists {len(p.devices)} devices for {p.num_subops} sub-ops",
                            op=op.name, where=op.where())
        unassigned = [i for i, d in enumerate(p.devices) if d is None]
        if unassigned:
            raise PlanError(f"sub-op(s) {unassigned} of {p.num_subops} are not assigned to a device "
                            "(call op_assign on each sub-op op_trans returned)", op=op.name, where=op.where())
        for i, d in enumerate(p.devices):
            if not 0 <= d < plan.unit_size:
                raise PlanError(f"sub-op {i} is assigned to device {d}, outside the world of this plan's unit "
                                f"(devices 0..{plan.unit_size - 1})", op=op.name, where=op.where())
        if len(set(p.devices)) != len(p.devices):
            _check_coshard(p, op)
        if not p.splits:
            continue
        sig = signature_for(graph, op)
        call = op_call(graph, op)
        labels = sig.labels()
        blocks = getattr(sig, "blocks", None) or {}
        stray = sorted(set(p.blocks) - set(p.label_counts()))
        if stray:
            raise PlanError(f"gives blocks for dim(s) {stray} that the plan does not split", op=op.name,
                            where=op.where())
        for label, total in p.label_counts().items():
            if label not in labels:
                raise PlanError(f"splits dim {label!r} but its signature has labels {labels}", op=op.name,
                                where=op.where())
            if sig.is_frozen(label):
                raise PlanError(f"splits dim {label!r}, which its rule keeps whole", op=op.name, where=op.where())
            own_block = p.blocks.get(label, 1)
            if own_block != 1:
                why = sig.blockable(label, call) if abs(own_block) > 1 else "block must be >= 2 (or <= -2: mirrored)"
                if why is not None:
                    raise PlanError(f"splits dim {label!r} in {own_block} blocks, but {why}", op=op.name,
                                    where=op.where())
            if not sig.divides(label, total, call, own_block):
                block = max([b for (l, _i), b in blocks.items() if l == label], default=own_block)
                extra = f" (in each of {block} blocks)" if block > 1 else ""
                raise PlanError(f"split of dim {label!r} (size {sig.size_of(label, call)}) into {total} pieces "
                                f"does not divide it{extra}; use a number of pieces that divides every dim carrying "
                                f"{label!r}", op=op.name, where=op.where())


def _validate_pipeline(plan: Plan, graph: Graph) -> None:
    """Stages cover every op, follow the model's data flow, run on their own devices, and the
    schedule passes the dry run."""
    from nnscaler_plugins.plan.timeline import check

    spec = plan.pipeline
    groups = [set(g) for g in spec.stage_devices]
    for k, g in enumerate(spec.stage_devices):
        bad = [d for d in g if not 0 <= d < plan.unit_size]
        if bad or not g:
            raise PlanError(f"pipeline stage {k} runs on devices {g}, outside the plan's unit "
                            f"(devices 0..{plan.unit_size - 1})")
    stage_of: dict[str, int] = {}
    for op in graph.ops:
        p = plan.ops.get(op.name)
        if p is None:
            continue  # reported by the caller
        if p.stage is None or not 0 <= p.stage < spec.num_stages:
            raise PlanError(f"has stage {p.stage}; the pipeline has stages 0..{spec.num_stages - 1}", op=op.name,
                            where=op.where())
        outside = [d for d in p.devices if d is not None and d not in groups[p.stage]]
        if outside:
            raise PlanError(f"runs on devices {outside}, outside its pipeline stage {p.stage} "
                            f"(devices {spec.stage_devices[p.stage]})", op=op.name, where=op.where())
        for o in op.outputs:
            if o is not None:
                stage_of[o] = p.stage
        for name in op.inputs:
            src = stage_of.get(name)
            if src is not None and src > p.stage:
                producer = graph.op(graph.values[name].producer)
                raise PlanError(f"in stage {p.stage} uses {name}, made in the later stage {src} by "
                                f"{producer.where()}; stages must follow the model's order", op=op.name,
                                where=op.where())
    try:
        lists = spec.task_lists()
    except ValueError as e:
        raise PlanError(f"pipeline schedule {spec.schedule!r}: {e}") from None
    check(lists, spec.shape())


def _check_coshard(p, op) -> None:
    """Several sub-ops on one device are a co-shard: each device takes the same number of
    consecutive pieces of the op's innermost split and runs them one after another."""
    c = p.coshard
    why = None
    if not p.splits:
        why = "a replicated op cannot place two copies on one device"
    elif len(p.devices) % c or p.splits[-1][1] % c:
        why = f"each device must take the same number of pieces of the innermost split ({p.splits[-1]})"
    else:
        runs = [p.devices[i:i + c] for i in range(0, len(p.devices), c)]
        if any(len(set(r)) != 1 for r in runs) or len({r[0] for r in runs}) != len(runs):
            why = (f"devices {p.devices} do not give each device {c} consecutive pieces of the innermost split "
                   f"{p.splits[-1][0]!r}")
    if why:
        raise PlanError(f"two sub-ops are assigned to one device, which is a co-shard, but {why}; assign sub-op i "
                        f"to device i // pieces_per_device", op=op.name, where=op.where())
