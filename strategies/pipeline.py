"""Pipeline parallelism, alone or with tensor and data parallelism (3-D plans), and the `megatron`
strategy that writes down a published Megatron-LM configuration.

The layer stack is cut into `pp * virtual_stages` contiguous stages of equal layer counts (the ops
before the layers join the first stage, the ops after them the last). Stage k runs on pipeline
rank k % pp, whose devices are the `tp` consecutive devices pp_rank * tp .. pp_rank * tp + tp - 1
of the unit; inside a stage the ops get the same Megatron tensor parallelism `tp` gives a whole
model. Data parallelism replicates the unit `dp` times. Everything is expressed with op_trans,
op_assign and op_order, so the result is an ordinary plan: saved, checked and explained like any.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.layers import balanced_stages, layer_groups
from nnscaler_plugins.plan.primitives import PlanBuilder

from .batch_statistics import apply_batch_statistics
from .propagation import TensorParallelPropagation
from .recompute import apply_recompute
from .sequence_parallel import apply_sequence_parallel

DEFAULT_SCHEDULE = "1f1b"


def resolve(world_size: int, pp: Optional[int] = None, tp: Optional[int] = None, dp: Optional[int] = None,
            strategy: str = "pipeline") -> tuple[int, int, int]:
    """(pp, tp, dp) with pp * tp * dp == world_size; tp defaults to 1, the missing one is derived."""
    tp = 1 if tp is None else int(tp)
    for name, value in (("pp", pp), ("tp", tp), ("dp", dp)):
        if value is not None and (int(value) < 1 or world_size % int(value)):
            raise PlanError(f"strategy {strategy!r}: {name}={value} does not divide the world size {world_size}")
    if pp is None and dp is None:
        pp, dp = world_size // tp, 1
    elif pp is None:
        pp = world_size // (tp * int(dp))
    elif dp is None:
        dp = world_size // (tp * int(pp))
    pp, dp = int(pp), int(dp)
    if pp * tp * dp != world_size:
        raise PlanError(f"strategy {strategy!r}: pp={pp} x tp={tp} x dp={dp} = {pp * tp * dp}, but the world size "
                        f"is {world_size}")
    return pp, tp, dp


def degrees(world_size: int, pp: Optional[int] = None, tp: Optional[int] = None, dp: Optional[int] = None,
            **_: Any) -> tuple[int, int]:
    pp, tp, dp = resolve(world_size, pp, tp, dp)
    return pp * tp, dp


def pipeline(builder: PlanBuilder, *, schedule: str = DEFAULT_SCHEDULE, pp: Optional[int] = None,
             tp: Optional[int] = None, virtual_stages: int = 1, recompute: Any = None,
             sequence_parallel: bool = False, batch_statistics: Optional[str] = None, **_: Any) -> None:
    """Stages of equal layer counts on pp device groups of tp devices each, ordered by `schedule`.
    The loss's nonlinear statistics over the batch (a router loss) are whole only without
    micro-batches (see `batch_statistics.apply_batch_statistics`)."""
    tp = 1 if tp is None else int(tp)
    pp = builder.unit_size // tp if pp is None else int(pp)
    if pp * tp != builder.unit_size:
        raise PlanError(f"pp={pp} x tp={tp} does not match the plan's unit of {builder.unit_size} devices")
    virtual_stages = int(virtual_stages)
    if virtual_stages > 1 and schedule != "interleaved" and not callable(schedule):
        raise PlanError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule (got {schedule!r})")
    groups = layer_groups(builder.graph)
    num_stages = pp * virtual_stages
    try:
        stages = balanced_stages(groups, num_stages)
    except ValueError as e:
        raise PlanError(f"cannot cut {builder.graph.model_class} into {num_stages} pipeline stages: {e}") from None
    rank_devices = [list(range(r * tp, (r + 1) * tp)) for r in range(pp)]
    stage_devices = [rank_devices[k % pp] for k in range(num_stages)]
    _tensor_parallel_stages(builder, stages, stage_devices, sequence_parallel=bool(sequence_parallel))
    apply_recompute(builder, recompute)
    builder.op_order([[op.name for op in ops] for ops in stages], stage_devices, schedule=schedule)
    apply_batch_statistics(builder, builder.strategy, batch_statistics)


def _tensor_parallel_stages(builder: PlanBuilder, stages: list[list[Any]], stage_devices: list[list[int]],
                            sequence_parallel: bool = False) -> None:
    """Megatron tensor parallelism inside each stage, over that stage's own devices; values enter
    and leave a stage whole, as the executor moves them."""
    handles = {op.name: op for op in builder.ops}
    for ops, devices in zip(stages, stage_devices):
        segment = [handles[op.name] for op in ops]
        prop = TensorParallelPropagation(builder, degree=len(devices), devices_of=lambda op, d=devices: d,
                                         ops=segment)
        if sequence_parallel:
            apply_sequence_parallel(prop)
        prop.apply()


def interlaced_pipeline(builder: PlanBuilder, *, pp: Optional[int] = None, tp: Optional[int] = None,
                        recompute: Any = None, batch_statistics: Optional[str] = None, **_: Any) -> None:
    """The interlaced pipeline: the layers in pp stages (tp devices each) while what comes before
    them (a large embedding) and after them (the LM head and its loss) are tensor-parallel across
    every device of the unit, as two shared stages the schedule interlaces into the 1F1B order."""
    tp = 1 if tp is None else int(tp)
    pp = builder.unit_size // tp if pp is None else int(pp)
    if pp * tp != builder.unit_size:
        raise PlanError(f"pp={pp} x tp={tp} does not match the plan's unit of {builder.unit_size} devices")
    groups = layer_groups(builder.graph)
    if not groups.pre or not groups.post:
        raise PlanError(f"the interlaced pipeline needs ops before and after the layer stack of "
                        f"{builder.graph.model_class} (an embedding and an LM head); found "
                        f"{len(groups.pre)} before and {len(groups.post)} after")
    try:
        layer_stages = balanced_stages(type(groups)(groups.prefix, [], groups.layers, []), pp)
    except ValueError as e:
        raise PlanError(f"cannot cut {builder.graph.model_class} into {pp} layer stages: {e}") from None
    everyone = list(range(builder.unit_size))
    stages = [groups.pre] + layer_stages + [groups.post]
    stage_devices = [everyone] + [list(range(r * tp, (r + 1) * tp)) for r in range(pp)] + [everyone]
    _tensor_parallel_stages(builder, stages, stage_devices)
    apply_recompute(builder, recompute)
    builder.op_order([[op.name for op in ops] for ops in stages], stage_devices, schedule="interlaced",
                     stage_rank=[-1] + list(range(pp)) + [-1])
    apply_batch_statistics(builder, builder.strategy, batch_statistics)


def _named(schedule: str):
    def apply(builder: PlanBuilder, **options: Any) -> None:
        options.pop("schedule", None)
        if schedule == "interleaved":
            options.setdefault("virtual_stages", 2)
        pipeline(builder, schedule=schedule, **options)

    apply.__name__ = schedule.replace("-", "_")
    apply.__doc__ = f"Pipeline with the {schedule!r} schedule; options pp, tp, dp, micro_batches" + (
        ", virtual_stages (default 2)" if schedule == "interleaved" else "") + "."
    return apply


gpipe = _named("gpipe")
one_f_one_b = _named("1f1b")
interleaved = _named("interleaved")
zero_bubble = _named("zero-bubble")


def megatron_degrees(world_size: int, pp: Optional[int] = None, tp: Optional[int] = None,
                     dp: Optional[int] = None, **_: Any) -> tuple[int, int]:
    """Like Megatron's arguments: pp and tp default to 1, dp is what is left."""
    if pp is None and dp is None:
        pp = 1
    pp, tp, dp = resolve(world_size, pp, tp, dp, "megatron")
    return pp * tp, dp


def megatron(builder: PlanBuilder, *, tp: Optional[int] = None, pp: Optional[int] = None, dp: Optional[int] = None,
             schedule: Optional[str] = None, virtual_stages: int = 1, sequence_parallel: bool = False,
             recompute: Optional[str] = None, batch_statistics: Optional[str] = None, **_: Any) -> None:
    """A Megatron-LM configuration written down: tp x pp x dp, the schedule (1F1B, or interleaved
    with `virtual_stages` > 1), micro-batches (`micro_batches` or `micro_batch_size`, resolved by
    `nns.plan`), `sequence_parallel` (the layer norms, dropouts and residual adds split along the
    sequence dim, see `sequence_parallel.py`) and `recompute` ("full" | "selective"); the choices
    are also recorded in the plan's options for the cost model."""
    if recompute not in (None, "none", "full", "selective"):
        raise PlanError(f"megatron: recompute must be 'full', 'selective' or None (got {recompute!r})")
    schedule = schedule or ("interleaved" if int(virtual_stages) > 1 else DEFAULT_SCHEDULE)
    tp = 1 if tp is None else int(tp)
    pp = builder.unit_size // tp if pp is None else int(pp)
    if pp == 1:
        if int(virtual_stages) > 1:
            raise PlanError("megatron: virtual_stages needs pp > 1")
        prop = TensorParallelPropagation(builder, degree=tp)
        if sequence_parallel:
            apply_sequence_parallel(prop)
        prop.apply()
        apply_recompute(builder, recompute)
        apply_batch_statistics(builder, builder.strategy, batch_statistics)
    else:
        pipeline(builder, schedule=schedule, pp=pp, tp=tp, virtual_stages=virtual_stages, recompute=recompute,
                 sequence_parallel=sequence_parallel, batch_statistics=batch_statistics)
    builder.options.update({"sequence_parallel": bool(sequence_parallel), "recompute": recompute or "none"})
