"""Expert parallelism: each MoE layer's experts split over the mesh's "ep" devices, optionally each
expert's width over "etp" (Megatron's expert tensor parallelism), the dense part data-parallel
inside the unit, or tensor-parallel in groups of `tp=` devices (Megatron's "parallel folding").

The mesh is {"dp", "pp", "ep", "etp"}; the plan's `dp` copies of the unit are expert-data-parallel:
an expert's gradient is reduced only among the replicas that hold it, a dense weight's among every
device (the unit's batch split gives partial sums the lowering reduces inside the unit). ZeRO
shards what each device holds across its replicas: expert state among the replicas of the same
experts only. The passes: `apply_ep` (experts), `apply_batch_split` (the dense part's batch),
`apply_tp` (the dense part's tensor parallelism, with tp= or inside pipeline stages), `apply_pp`.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import (
    DEFAULT_SCHEDULE,
    Parallelization,
    apply_batch_split,
    apply_batch_statistics,
    apply_ep,
    apply_pp,
    apply_recompute,
    apply_tp,
    is_experts_op,
    order,
)
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder


def _check(world_size: int, ep: Optional[int] = None, etp: Optional[int] = None, tp: Optional[int] = None,
           pp: Optional[int] = None, dp: Optional[int] = None) -> Optional[dict]:
    """ep's own rules: tp (the dense part's) divides ep x etp, equals it with a pipeline, and gives
    ep when ep is not said (ep = tp / etp)."""
    e = int(etp or 1)
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
        return {"ep": int(tp) // e}
    return None


#: ep takes the world / (etp x pp) unless dp= says otherwise; tp= (the dense part's) is laid over the
#: ep x etp devices, not beside them.
MESH = MeshLayout(("dp", "pp", "ep", "etp"), fill=("ep", "dp"), check=_check, folded=("tp",))


def expert_parallel(builder: PlanBuilder, *, capacity_factor: Any = None, schedule: Any = None,
                    recompute: Any = None, batch_statistics: Optional[str] = None, **options: Any) -> None:
    """Experts split ep ways with their tokens (and etp ways along each expert's width); everything
    else split along the batch inside the unit, or tensor-parallel with `tp`."""
    par = Parallelization(builder, MESH, options)
    apply_ep(par, capacity_factor)
    apply_batch_statistics(builder, batch_statistics)
    dense = [op for op in builder.ops if not is_experts_op(op)]
    if par.pp > 1:
        apply_pp(par, schedule or DEFAULT_SCHEDULE)
        for op in dense:
            par.set_view(op, (("tp", par.group_size),))  # each stage's dense ops tensor-parallel over its devices
        apply_tp(par, check="none")
        par.place()
        apply_recompute(builder, recompute)
        order(par, schedule or DEFAULT_SCHEDULE)
        return
    tp = dict(builder.mesh.folded).get("tp", 1)
    if tp > 1:
        for op in dense:
            par.set_view(op, (("batch", builder.unit_size // tp), ("tp", tp)))
        apply_tp(par, check="none")
        apply_batch_split(par, ("batch",))
    else:
        apply_batch_split(par, ("ep", "etp"))
    par.place()
    apply_recompute(builder, recompute)


# Read by the entry points before capture (capture/experts.py: wants_experts_as_one_op).
expert_parallel.experts_as_one_op = True  # type: ignore[attr-defined]
