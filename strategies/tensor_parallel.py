"""Megatron-style tensor parallelism found by layout propagation (see `propagation`).

No module names and no model classes: column/row pairs, head-parallel attention, vocabulary-
parallel embeddings and cross-entropy all fall out of the ops' dimension rules, so models the
strategy was never shown get the same treatment as GPT-2 and Llama.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.primitives import PlanBuilder

from .propagation import TensorParallelPropagation


def resolve_degrees(world_size: int, tp: Optional[int], dp: Optional[int], strategy: str) -> tuple[int, int]:
    """(tp, dp) with tp * dp == world_size, filling in whichever one is missing."""
    if tp is None and dp is None:
        raise PlanError(f"strategy {strategy!r} needs tp= and/or dp= (their product is the world size {world_size})")
    for name, value in (("tp", tp), ("dp", dp)):
        if value is not None and (value < 1 or world_size % value):
            raise PlanError(f"{name}={value} does not divide the world size {world_size}")
    tp = tp if tp is not None else world_size // dp
    dp = dp if dp is not None else world_size // tp
    if tp * dp != world_size:
        raise PlanError(f"tp={tp} x dp={dp} = {tp * dp}, but the world size is {world_size}")
    return tp, dp


def degrees(world_size: int, tp: Optional[int] = None, dp: Optional[int] = None, **_: Any) -> tuple[int, int]:
    """(unit_size, dp): the whole world is one tensor-parallel unit unless `tp` or `dp` says otherwise."""
    if tp is None and dp is None:
        return world_size, 1
    return resolve_degrees(world_size, tp, dp, "tp")


def tensor_parallel(builder: PlanBuilder, **options: Any) -> None:
    """Split the model across the unit's devices; every op gets a split or runs whole."""
    tp = options.get("tp")
    if tp is not None and tp != builder.unit_size:
        raise PlanError(f"tp={tp} but the plan's unit has {builder.unit_size} devices; the tensor-parallel "
                        "degree is the unit size")
    TensorParallelPropagation(builder).apply()
