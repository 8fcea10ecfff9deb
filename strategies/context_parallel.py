"""Context parallelism: the sequence split over the mesh's "cp" devices (x "tp", x "pp" stages).

A composition of passes: `apply_pp` cuts the stages when pp > 1, `apply_tp` finds Megatron tensor
parallelism inside each sequence chunk's group, `apply_cp` follows the sequence from the data
inputs and every self-attention through the ops' rules (ring, all-gather or Ulysses attention
pieces; causal load balancing by default). Device (t, c) of a pipeline rank is its first device
+ t * cp + c: the cp devices of one tensor-parallel rank are neighbours, as the ring wants them.
See `nnscaler_plugins.passes.context_parallel` for what is refused before launch.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.passes import (
    DEFAULT_SCHEDULE,
    Parallelization,
    apply_batch_statistics,
    apply_cp,
    apply_pp,
    apply_recompute,
    apply_tp,
    order,
)
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder

#: The whole world one context-parallel unit unless cp= or dp= says otherwise; tp and pp default to 1.
MESH = MeshLayout(("dp", "pp", "tp", "cp"), fill=("cp", "dp"))
MODES = ("ring", "allgather", "ulysses")


def context_parallel(builder: PlanBuilder, *, cp_comm: str = "ring", balance: Optional[bool] = None,
                     schedule: Any = DEFAULT_SCHEDULE, virtual_stages: int = 1, recompute: Any = None,
                     batch_statistics: Optional[str] = None, **options: Any) -> None:
    """Split the sequence over cp devices (x tp: Megatron's cp x tp; x pp: the layer stack cut into
    pipeline stages as the pipeline strategies cut it); see the module doc."""
    par = Parallelization(builder, MESH, options)
    if par.pp > 1 and schedule == "interleaved" and int(virtual_stages) == 1:
        virtual_stages = 2
    apply_pp(par, schedule, virtual_stages)
    tp = apply_tp(par, check="each" if par.pp == 1 else "any")
    apply_cp(par, str(cp_comm), balance, tp)
    par.place()
    apply_recompute(builder, recompute)
    order(par, schedule)
    apply_batch_statistics(builder, batch_statistics)
