"""The plan's `batch_statistics`: what every strategy with data-parallel replicas or micro-batches
records, so a loss that uses a reduction over the batch nonlinearly (a mixture-of-experts router's
load-balancing loss) trains as one device on the whole batch does. Finding them is the core's
(`nnscaler_plugins.lower.batch_statistics`, which also fills them in for a ready-made plan); the
choice between the whole batch's and each replica's own is the strategy option read here.
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.batch_statistics import batch_statistics, refuse_micro_batches
from nnscaler_plugins.plan.primitives import PlanBuilder


def apply_batch_statistics(builder: PlanBuilder, strategy: str, mode: Optional[str]) -> None:
    """Records the plan's `batch_statistics` for the lowering: "global" (the default) combines them
    across data-parallel replicas; "local" keeps each replica's own (Hugging Face under DDP).
    Micro-batches see one micro-batch each, which no order of the forwards makes whole before
    the first backward in 1F1B; "global" with micro-batches is refused when there are any.

    Every strategy calls this, so a plan without such reductions (a dense LM, batch norm under
    DDP's per-replica convention) records nothing and plans exactly as before."""
    mode = mode or "global"
    if mode not in ("global", "local"):
        raise PlanError(f"strategy {strategy!r}: batch_statistics={mode!r}; use 'global' or 'local'")
    if mode == "local":
        builder.options["batch_statistics"] = "local"
        return
    found = batch_statistics(builder, strategy)
    if not found:
        return
    micro = builder.pipeline.micro_batches if builder.pipeline is not None else builder.micro_batches
    if micro > 1:
        refuse_micro_batches(builder, strategy, found, micro)
    builder.options["batch_statistics"] = found


__all__ = ["apply_batch_statistics", "batch_statistics"]
