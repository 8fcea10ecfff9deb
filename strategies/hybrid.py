"""Tensor parallelism inside a unit, data parallelism across units.

The unit's plan is exactly the tensor-parallel one; the `dp` copies of it are the runtime's
business (builder.dp), so nothing here differs from `tp` but the degrees, which must both be
given or follow from each other.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.plan.primitives import PlanBuilder

from .tensor_parallel import resolve_degrees, tensor_parallel


def degrees(world_size: int, tp: Optional[int] = None, dp: Optional[int] = None, **_: Any) -> tuple[int, int]:
    """(tp, dp) with tp * dp == world_size; one of them may be left out."""
    return resolve_degrees(world_size, tp, dp, "hybrid")


def hybrid(builder: PlanBuilder, **options: Any) -> None:
    """The tensor-parallel plan for one unit; the builder already carries the data-parallel degree."""
    tensor_parallel(builder, **{k: v for k, v in options.items() if k != "dp"})
