"""Which gradients one device's reducer sums, over which groups, and at ZeRO-2 which it keeps as
chunks: the `GradReducer` of a ParallelModule (`runtime/grad_reducer.py` runs it).

A parameter gets a reducer entry when its gradient is summed over more than this rank: the
devices of its unit that hold the same piece, times the data-parallel replicas (averaged by
1/dp). ZeRO-3 needs none: its gathers reduce-scatter their own gradients.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from nnscaler_plugins.runtime.grad_reducer import GradReducer
from nnscaler_plugins.runtime.plan_groups import replicas_of
from nnscaler_plugins.runtime.zero import FlatShard

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


def build_reducer(program: Program, trainable: list[str], parameter: Callable[[str], torch.nn.Parameter],
                  unit_device: int, groups: Any, zero_shards: dict[str, FlatShard],
                  scatter: Callable[[], bool]) -> Optional[GradReducer]:
    """The reducer of this device's trainable shards (`trainable`, keys in Program order); None when
    no gradient needs reducing. `scatter` says, per reduction, whether ZeRO-2 keeps chunks."""
    plan = program.plan
    entries, tied = [], []
    zero2, zero2_whole = {}, {}
    for v in trainable:
        s = program.shards[v]
        ranks = replicas_of(plan, s.reduce_group(unit_device))
        if len(ranks) > 1:
            p = parameter(s.fqn)
            (tied if s.tied else entries).append((s.fqn, p, ranks))
            fs = zero_shards[s.fqn]
            if plan.zero == 2 and fs.size > 1:
                (zero2 if fs.sum_group is None else zero2_whole)[id(p)] = fs
    # Copies of a tied weight sit among different parameters on each stage: order them by name
    # so every member of their group reduces them in the same order.
    entries = [(p, r) for _, p, r in entries + sorted(tied, key=lambda e: e[0])]
    if not entries:
        return None
    scale = 1.0 / plan.dp
    return GradReducer([(p, groups.get(r), scale) for p, r in entries], shards=zero2,
                       chunk_after=zero2_whole, scatter=scatter,
                       overlap=plan.knobs.overlap_grad_reduce is not False,
                       in_order=plan.knobs.executor == "eager")
