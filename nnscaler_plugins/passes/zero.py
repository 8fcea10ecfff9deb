"""ZeRO as a pass: the stage at which data-parallel replicas shard the training state.

Stage 1 shards the optimizer state (fp32 master weights and moments) across the replicas of the
mesh's "dp" axis, 2 also the gradients, 3 also the parameters (gathered just before the forward and
again for backward, freed in between). It is a knob of the plan that the runtime and
`nns.build_optimizer` honour; with one replica there is nothing to shard across, and the runtime
runs it as stage 0 (a no-op, not an error), so a plan scales down to one process.
"""
from __future__ import annotations

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.primitives import PlanBuilder


def apply_zero(builder: PlanBuilder, stage: int) -> None:
    """Set the plan's ZeRO stage; a different stage asked for with `zero=` is refused by name."""
    if builder.zero_stage not in (0, stage):
        raise PlanError(f"strategy {builder.strategy!r} is ZeRO stage {stage}, but zero={builder.zero_stage} was also "
                        f"given; drop zero= or use strategy='dp' with zero={builder.zero_stage}")
    builder.zero(stage)
