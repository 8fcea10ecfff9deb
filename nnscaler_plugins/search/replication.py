"""How much of its work a searched plan does twice: the measure that keeps the search parallel.

A device group runs each op split (every device a share of it) or copied (every device the whole
op, or the whole of its piece). Copies need no communication, so where collectives are slow next to
the ops (a CPU, a small model: the per-op launch costs do not shrink with the batch, and every
all-reduce pays the link's latency) the cost model can price "every device runs every op" faster
than data parallelism. Such a plan uses its group like one device: the other devices compute the
same numbers again, and a world of N processes trains no faster than one. The search therefore
reads how much of the model's work a plan duplicates, and keeps (when it has any) only plans that
duplicate little (`PARALLEL`); the label of a plan that copies every op says so.

The work of an op is its FLOPs, forward and backward (the cost model's `OpCost`): what a device
would have to compute alone. An op copied `c` times over a group of `g` does `c - 1` of its work
again; a plan's duplicated share is that summed over its ops, over `(g - 1)` times the model's
work: 0 when every op is split over the whole group (data parallelism), 1 when every op runs whole
on every device.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Optional

from nnscaler_plugins.search.opcost import OpCost

#: A plan counts as parallel when its devices duplicate at most this share of the work they could
#: divide (tensor parallelism copies norms, embeddings' lookups and residual adds: a few per cent).
PARALLEL = 0.25


def op_work(cost: OpCost) -> float:
    """An op's FLOPs, forward and backward (the work a device would do alone)."""
    return float(cost.flops + cost.flops_input_grad + cost.flops_weight_grad)


def duplicated_share(ops: Iterable[tuple[OpCost, int]], group: int) -> float:
    """Of the work a group of `group` devices could divide, the share its copies compute again;
    `ops` are (cost, copies) pairs, `copies` the devices that compute each piece of the op."""
    if group <= 1:
        return 0.0
    total = again = 0.0
    count = extra = 0
    for cost, copies in ops:
        if cost.kind == "view":
            continue
        w = op_work(cost)
        total += w
        again += w * (copies - 1)
        count += 1
        extra += copies - 1
    if total > 0:
        return again / (total * (group - 1))
    return extra / (count * (group - 1)) if count else 0.0  # no FLOPs anywhere: count ops instead


def batch_degree(choices: Mapping[str, object], batch_label: Callable[[str], Optional[str]]) -> int:
    """The largest split of an op along its batch label (1 when no op splits the batch); `choices`
    are op name -> `intraop.Choice`."""
    best = 1
    for name, ch in choices.items():
        label = batch_label(name)
        if label is None:
            continue
        best = max(best, math.prod(n for l, n in ch.axes if l == label))
    return best
