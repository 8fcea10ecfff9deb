"""Adopting a finished plan in a `PlanBuilder`: how a searched plan becomes a strategy's output.

`strategy="auto"` runs inside `nns.plan`, which hands it a builder for the graph and the unit; the
search returns plans. Replaying a plan's placements and op-order through the builder's primitives
(op_trans, op_assign, op_order) makes the result an ordinary strategy output, checked like any.
"""
from __future__ import annotations

from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.primitives import PlanBuilder


def adopt(builder: PlanBuilder, plan: Plan) -> None:
    """Record `plan`'s splits, devices, pipeline, recompute groups, ZeRO stage, precision, mesh and
    knobs on `builder` (same graph and unit size)."""
    if plan.unit_size != builder.unit_size:
        raise ValueError(f"plan has a unit of {plan.unit_size} devices, the builder {builder.unit_size}")
    for handle in builder.ops:
        p = plan.ops[handle.name]
        subs = None
        if p.replicate > 1:
            subs = builder.op_trans(handle, replicate=p.replicate)
        for label, n in p.splits:
            subs = builder.op_trans(handle, dim=label, num=n, block=p.blocks.get(label, 1))
        if subs is None:
            builder.replicate(handle, devices=[p.devices[0]])
            continue
        for sub, d in zip(subs, p.devices):
            builder.op_assign(sub, d)
    if plan.pipeline is not None:
        spec = plan.pipeline
        stages = [[] for _ in range(spec.num_stages)]
        for handle in builder.ops:
            stages[plan.ops[handle.name].stage].append(handle.name)
        builder.op_order(stages, spec.stage_devices, micro_batches=spec.micro_batches, schedule=spec.schedule,
                         stage_rank=spec.stage_rank, split_backward=spec.split_backward, **spec.options)
    groups: dict[int, list] = {}  # recompute groups: the cost model priced them, the runtime runs them
    for handle in builder.ops:
        gid = plan.ops[handle.name].recompute
        if gid is not None:
            groups.setdefault(gid, []).append(handle)
    for gid in sorted(groups):
        builder.recompute(groups[gid])
    builder.zero(plan.zero)
    builder.precision(plan.precision)
    builder.set_mesh(plan.mesh)
    # how the plan computes; the builder's own knobs (batch statistics, the runtime settings) stay
    builder.set_knobs(**{k: getattr(plan.knobs, k) for k in ("recompute", "sequence_parallel", "cp_comm",
                                                               "capacity_factor", "experts_as_one_op", "cluster")})
    builder.options.update({k: v for k, v in plan.options.items() if isinstance(v, (int, float, str, bool))})
    if plan.estimate is not None:
        builder.options["estimated_step_s"] = float(plan.estimate.get("step_time_s", 0.0))
        builder.options["estimated_peak_bytes"] = float(plan.estimate.get("max_memory_bytes", 0.0))
