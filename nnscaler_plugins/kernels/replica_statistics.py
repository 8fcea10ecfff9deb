"""A statistic over the batch combined across data-parallel replicas, so the loss built on it is one
device's loss on the whole batch.

Data-parallel replicas each run the same program on their share of the batch, and the loss of each
is weighted by its share of the items before the gradients are averaged (`ParallelModule.train_step`).
That is exact when the loss is linear in every reduction over the batch (a mean cross-entropy). A
loss that multiplies two batch reductions -- the router's load-balancing loss of a mixture-of-experts
model: the fraction of tokens routed to each expert times the mean router probability -- is not: the
mean of per-replica products is not the product of the whole batch's means. Such a reduction is made
whole on every replica here, before anything reads it.

What a replica's program does with the reduction was captured for its own batch: a mean is a
mean, and a sum is read as its batch's sum (later divided by the batch's size, or by another sum
over it). So each replica is given the whole batch's value at its own scale. With `a_r = n_r / N`
(the elements replica r reduced over, of all replicas'):

- a mean: `sum_s a_s x_s` (the whole batch's mean);
- a sum: `a_r sum_s x_s` (the whole batch's sum, scaled to this replica's share), so a sum over
  a batch divided by the batch's size, or a ratio of two sums, is the whole batch's.

Backward: replica r's loss enters the averaged gradients with weight `w_r / dp` (the weights add
up to dp), so the gradient each replica gives its own `x` is the all-reduce of what the forward's
transpose makes of every replica's incoming gradient: `a_r sum_s g_s` for a mean,
`sum_s a_s g_s` for a sum.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function


class _AcrossReplicas(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, share: float, mean: bool, group: Any) -> torch.Tensor:
        ctx.share, ctx.mean, ctx.group = share, mean, group
        out = (x * share if mean else x.clone()).contiguous()
        dist.all_reduce(out, group=group)
        return out if mean else out * share

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g = (grad * ctx.share if not ctx.mean else grad.clone()).contiguous()
        dist.all_reduce(g, group=ctx.group)
        return (g * ctx.share if ctx.mean else g), None, None, None


def across_replicas(x: torch.Tensor, counted: torch.Tensor, dims: Sequence[int] = (), mean: bool = False, *,
                    group: Any) -> torch.Tensor:
    """The whole batch's value of the batch reduction `x` (this replica's part), at this replica's
    scale; `counted` is the input it reduced over `dims` (all when empty), which says how many
    elements this replica holds. `group` is this device's data-parallel replicas."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    mine = float(math.prod(counted.shape[d] for d in dims) if dims else counted.numel())
    total = torch.tensor([mine], dtype=torch.float64, device=x.device)
    dist.all_reduce(total, group=group)
    share = mine / total.item() if total.item() > 0 else 0.0
    return _AcrossReplicas.apply(x, share, mean, group)
