"""Pipeline parallelism over the mesh's "pp" axis: the layer stack cut into stages, each on one
pipeline rank's devices, and the micro-batches ordered through them by a schedule.

`apply_pp` cuts the stages (`pp * virtual_stages` contiguous stages of equal layer counts; the ops
before the layers join the first stage, the ops after them the last; stage k runs on pipeline rank
k % pp) and records them on the `Parallelization`, so the passes that follow split each stage's ops
over that stage's own devices. `order` (after `place`) writes the op-order: `op_order` with the
stages' device groups and the schedule, which is dry-run there, so a broken schedule fails before
launch. The interlaced pipeline adds two stages every rank shares (the embedding before the layers,
the head and loss after them), which run on all the unit's devices.
"""
from __future__ import annotations

from typing import Any, Callable, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes.parallelization import Parallelization, Stage
from nnscaler_plugins.plan.layers import balanced_stages, layer_groups

DEFAULT_SCHEDULE = "1f1b"


def apply_pp(par: Parallelization, schedule: Union[str, Callable[..., Any]] = DEFAULT_SCHEDULE,
             virtual_stages: int = 1, interlaced: bool = False, always: bool = False) -> list[Stage]:
    """Cut the graph into pipeline stages over the mesh's "pp" axis; returns them. With pp 1 there
    are none unless `always` (a pipeline strategy keeps its one stage and schedule). `interlaced`:
    the layers in pp stages, what comes before and after them in two shared stages."""
    builder = par.builder
    pp = par.pp
    virtual_stages = int(virtual_stages)
    name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
    if virtual_stages < 1:
        raise PlanError(f"virtual_stages={virtual_stages} must be >= 1")
    if virtual_stages > 1 and name != "interleaved" and not callable(schedule):
        raise PlanError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule (got {schedule!r})")
    if pp == 1 and not interlaced and not always:
        if virtual_stages > 1:
            raise PlanError(f"virtual_stages={virtual_stages} needs pp > 1")
        return []
    groups = layer_groups(builder.graph)
    handles = {op.name: op for op in builder.ops}
    if interlaced:
        if not groups.pre or not groups.post:
            raise PlanError(f"the interlaced pipeline needs ops before and after the layer stack of "
                            f"{builder.graph.model_class} (an embedding and an LM head); found "
                            f"{len(groups.pre)} before and {len(groups.post)} after")
        try:
            layer_stages = balanced_stages(type(groups)(groups.prefix, [], groups.layers, []), pp)
        except ValueError as e:
            raise PlanError(f"cannot cut {builder.graph.model_class} into {pp} layer stages: {e}") from None
        cut = [groups.pre] + layer_stages + [groups.post]
        ranks = [None] + list(range(pp)) + [None]
    else:
        num_stages = pp * virtual_stages
        try:
            cut = balanced_stages(groups, num_stages)
        except ValueError as e:
            raise PlanError(f"cannot cut {builder.graph.model_class} into {num_stages} pipeline stages (pp={pp}"
                            f"{f' x virtual_stages={virtual_stages}' if virtual_stages > 1 else ''}): {e}; choose a "
                            "pp of at most its number of layers, or pp=1") from None
        ranks = [k % pp for k in range(num_stages)]
    par.stages = [Stage(tuple(handles[op.name] for op in ops), r) for ops, r in zip(cut, ranks)]
    return par.stages


def order(par: Parallelization, schedule: Union[str, Callable[..., Any]] = DEFAULT_SCHEDULE, **options: Any) -> None:
    """The op-order of the stages `apply_pp` cut, with `schedule` (a built-in name or a function of
    your own); nothing without a pipeline."""
    if not par.stages:
        return
    shared = any(st.rank is None for st in par.stages)
    par.builder.op_order([[op.name for op in st.ops] for st in par.stages],
                         [par.devices(st.rank) for st in par.stages],
                         schedule="interlaced" if shared else schedule,
                         stage_rank=[-1 if st.rank is None else st.rank for st in par.stages] if shared else None,
                         **options)
