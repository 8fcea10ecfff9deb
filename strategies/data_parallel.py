"""Pure data parallelism: a unit of one device running the whole model.

Every rank runs the same program on its own slice of the batch; the runtime averages gradients
across the `dp` replicas of the unit. Expressing it as a one-device unit (rather than as a special
mode) keeps one code path for every strategy: the plan, the lowering and the runtime do not know
data parallelism is anything but `dp` copies of a unit.
"""
from __future__ import annotations

from typing import Any

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.primitives import PlanBuilder

from .batch_statistics import apply_batch_statistics
from .recompute import apply_recompute


def degrees(world_size: int, **options: Any) -> tuple[int, int]:
    """(unit_size, dp) = (1, world_size); a `tp` other than 1 is a request for another strategy."""
    tp = options.get("tp")
    if tp not in (None, 1):
        raise PlanError(f"strategy 'dp' has no tensor parallelism (got tp={tp}); use strategy='hybrid' "
                        f"with tp={tp}, dp={world_size // tp if tp and world_size % tp == 0 else '?'}")
    dp = options.get("dp")
    if dp not in (None, world_size):
        raise PlanError(f"strategy 'dp' uses every rank as a replica: dp must equal the world size "
                        f"{world_size} (got dp={dp})")
    return 1, world_size


def data_parallel(builder: PlanBuilder, **options: Any) -> None:
    """Run every op whole on the unit's only device. Each replica sees its share of the batch, so
    the loss's nonlinear statistics over the batch (a router's load-balancing loss) are made whole
    across the replicas unless `batch_statistics="local"` (also for the ZeRO stages, which run this)."""
    if builder.unit_size != 1:
        raise PlanError(f"strategy 'dp' plans a unit of one device, the builder has {builder.unit_size}; "
                        "use strategy='hybrid' to combine data and tensor parallelism")
    for op in builder.ops:
        builder.replicate(op, devices=[0])
    apply_recompute(builder, options.get("recompute"))
    apply_batch_statistics(builder, builder.strategy, options.get("batch_statistics"))
