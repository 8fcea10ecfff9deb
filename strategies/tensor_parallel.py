"""Megatron-style tensor parallelism found by layout propagation (see `propagation`).

No module names and no model classes: column/row pairs, head-parallel attention, vocabulary-
parallel embeddings and cross-entropy all fall out of the ops' dimension rules, so models the
strategy was never shown get the same treatment as GPT-2 and Llama.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.primitives import PlanBuilder

from .batch_statistics import apply_batch_statistics
from .propagation import TensorParallelPropagation
from .recompute import apply_recompute


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
    """Split the model across the unit's devices; every op gets a split or runs whole. A split of
    the batch inside the unit leaves partial sums the lowering adds up exactly; the `dp` copies of
    the unit (hybrid) get the loss's nonlinear batch statistics made whole across them."""
    tp = options.get("tp")
    if tp is not None and tp != builder.unit_size:
        raise PlanError(f"tp={tp} but the plan's unit has {builder.unit_size} devices; the tensor-parallel "
                        "degree is the unit size")
    TensorParallelPropagation(builder).apply()
    apply_recompute(builder, options.get("recompute"))
    apply_batch_statistics(builder, builder.strategy, options.get("batch_statistics"))


def coshard(builder: PlanBuilder, *, chunks: int = 2, modules: Optional[tuple[str, ...]] = None,
            **options: Any) -> None:
    """Tensor parallelism where every split op runs as `chunks` pieces per device, one after
    another, each recomputed in backward (co-shard): the same communication as `tp` with a
    fraction of its activation memory inside attention and MLP blocks.

    `modules` limits co-sharding to ops whose module path contains one of the given names (all
    split ops by default). Ops whose pieces must talk to each other (a vocabulary-parallel loss) or
    whose dim does not divide into devices x chunks stay plainly split.
    """
    chunks = int(chunks)
    if chunks < 1:
        raise PlanError(f"coshard: chunks must be >= 1 (got {chunks})")
    tp = options.get("tp")
    if tp is not None and tp != builder.unit_size:
        raise PlanError(f"tp={tp} but the plan's unit has {builder.unit_size} devices")
    propagation = TensorParallelPropagation(builder)
    choices = propagation.run()
    propagation.check_something_split()
    n = builder.unit_size
    for op in builder.ops:
        choice = choices[op.name]
        if choice.label is None:
            builder.replicate(op)
            continue
        wanted = modules is None or any(m in op.node.module_path for m in modules)
        c = chunks if (wanted and choice.label not in op.signature.comm_labels
                       and op.splittable(choice.label, n * chunks, choice.block)) else 1
        subs = builder.op_trans(op, dim=choice.label, num=n * c, block=choice.block)
        for i, sub in enumerate(subs):
            builder.op_assign(sub, i // c)
    apply_recompute(builder, options.get("recompute"))  # co-sharded ops are recomputed already
    apply_batch_statistics(builder, builder.strategy, options.get("batch_statistics"))
