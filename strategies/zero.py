"""ZeRO stages 1-3 as strategies: data parallelism whose replicas shard the training state.

`zero1` shards the optimizer state (fp32 master weights and moments) across the data-parallel
replicas, `zero2` also the gradients, `zero3` also the parameters (gathered just before the
forward and again for backward, freed in between). The plan is the `dp` plan; the stage is a plan
knob the runtime and `nns.build_optimizer` honour, which is also why every other strategy takes
`zero=` (e.g. `nns.plan(model, strategy="hybrid", tp=2, dp=2, zero=2)`).

With one replica (dp == 1) there is nothing to shard across: the stage is kept in the plan and
the runtime runs it as stage 0 (a no-op, not an error), so a plan scales down to one process.
"""
from __future__ import annotations

from typing import Any, Callable

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.primitives import PlanBuilder

from .data_parallel import data_parallel, degrees


def zero_stage(stage: int) -> Callable[..., None]:
    """The strategy function of ZeRO stage `stage` (data parallel plus the stage)."""

    def apply(builder: PlanBuilder, **options: Any) -> None:
        if builder.zero_stage not in (0, stage):
            raise PlanError(f"strategy 'zero{stage}' is ZeRO stage {stage}, but zero={builder.zero_stage} was also "
                            f"given; drop zero= or use strategy='dp' with zero={builder.zero_stage}")
        data_parallel(builder, **options)
        builder.zero(stage)

    apply.__name__ = f"zero{stage}"
    return apply


__all__ = ["zero_stage", "degrees"]
