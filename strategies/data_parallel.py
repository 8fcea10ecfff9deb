"""Pure data parallelism, and the ZeRO stages over it: a unit of one device running the whole model.

Every rank runs the same program on its own slice of the batch; the runtime averages gradients
across the mesh's "dp" replicas. Expressing it as a one-device unit (rather than as a special mode)
keeps one code path for every strategy: the plan, the lowering and the runtime do not know data
parallelism is anything but `dp` copies of a unit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import Parallelization, apply_batch_statistics, apply_recompute, apply_zero
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder


def _check(world_size: int, **degrees: Any) -> None:
    tp, dp = degrees.get("tp"), degrees.get("dp")
    if tp not in (None, 1):
        raise PlanError(f"strategy 'dp' has no tensor parallelism (got tp={tp}); use strategy='hybrid' "
                        f"with tp={tp}, dp={world_size // tp if tp and world_size % tp == 0 else '?'}")
    if dp not in (None, world_size):
        raise PlanError(f"strategy 'dp' uses every rank as a replica: dp must equal the world size "
                        f"{world_size} (got dp={dp})")


#: Every rank a replica of a one-device unit (`tp` is accepted only as 1, to name the mistake).
MESH = MeshLayout(("dp",), fill=("dp",), check=_check, extra=("tp",))


def data_parallel(builder: PlanBuilder, *, recompute: Any = None, batch_statistics: Optional[str] = None,
                  **options: Any) -> None:
    """Every op whole on the unit's only device. Each replica sees its share of the batch, so the
    loss's nonlinear statistics over the batch (a router's load-balancing loss) are made whole
    across the replicas unless `batch_statistics="local"`."""
    if builder.unit_size != 1:
        raise PlanError(f"strategy 'dp' plans a unit of one device, the builder has {builder.unit_size}; "
                        "use strategy='hybrid' to combine data and tensor parallelism")
    Parallelization(builder, MESH, options).place()
    apply_recompute(builder, recompute)
    apply_batch_statistics(builder, batch_statistics)


def zero_stage(stage: int) -> Callable[..., None]:
    """The strategy function of ZeRO stage `stage`: data parallelism plus the stage."""

    def apply(builder: PlanBuilder, **options: Any) -> None:
        apply_zero(builder, stage)
        data_parallel(builder, **options)

    apply.__name__ = f"zero{stage}"
    apply.__doc__ = f"Data parallelism with ZeRO stage {stage}."
    return apply
