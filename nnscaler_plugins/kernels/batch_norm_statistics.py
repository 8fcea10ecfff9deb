"""Batch norm in training over the whole global batch: every data-parallel replica normalizes with
the mean and variance of all replicas' rows, as one device on the whole batch does.

Batch norm in training normalizes each channel with the mean and (biased) variance over the batch
and spatial dims, and moves its running statistics toward that mean and the unbiased variance.
Replicas that each took their own shard's statistics (DDP without SyncBatchNorm) train another
model than one device does; the kernels here replace the op on each replica
(`lower.lowering`, for the ops `passes.batch_statistics` records as "batch_norm") and do what
`torch.nn.SyncBatchNorm` does, written against torch.distributed alone:

- forward: each replica's count, mean and sum of squared deviations per channel are gathered, and
  combined in replica order (Chan's parallel formula, in float64): the whole batch's mean and
  variance, the same numbers on every replica. The output is `(x - mean) / sqrt(var + eps) * w + b`;
  the running mean and variance (unbiased, with the global count) are updated in place from them.
- backward: with `xhat` the normalized input and `g` the incoming gradient, the input's gradient is
  `w / sqrt(var + eps) * (g - sum(g) / N - xhat * sum(g * xhat) / N)` where the sums run over every
  replica's rows (one all-reduce of the two per-channel sums) and N counts them all. The weight's
  and bias's gradients are this replica's sums; the gradient reducer adds the replicas' up.

Every replica's incoming gradient carries the same factor (`ParallelModule.train_step` weighs the
replicas' losses so that their averaged gradients are one device's), and the backward is linear in
those gradients, so the same factor comes out and the reducer's average removes it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.autograd import Function


def _dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.ndim))


def _shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.ndim - 2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def whole_batch_moments(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean, biased variance, count) per channel over every replica's rows of `x` (N, C, ...):
    each replica's (count, mean, squared deviations) gathered and combined in replica order, so
    every replica computes the same numbers."""
    c = x.shape[1]
    n = x.numel() // c if c else 0
    xf = x.detach().to(_compute_dtype(x))  # the local moments as torch's own kernel takes them; combined in float64
    if n:
        local_mean = xf.mean(_dims(x))
        m2 = ((xf - local_mean.view(_shape(x))) ** 2).sum(_dims(x)).to(torch.float64)
        mean = local_mean.to(torch.float64)
    else:
        mean = m2 = torch.zeros(c, dtype=torch.float64, device=x.device)
    mine = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=x.device), mean, m2])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    total = 0.0
    mean_all = torch.zeros(c, dtype=torch.float64, device=x.device)
    m2_all = torch.zeros(c, dtype=torch.float64, device=x.device)
    for p in parts:  # Chan et al.: combine (count, mean, M2) pairwise, in replica order
        nb, mb, qb = p[0].item(), p[1:1 + c], p[1 + c:]
        if nb == 0:
            continue
        both = total + nb
        delta = mb - mean_all
        mean_all = mean_all + delta * (nb / both)
        m2_all = m2_all + qb + delta * delta * (total * nb / both)
        total = both
    count = int(round(total))
    var = m2_all / count if count else m2_all
    return mean_all, var, count


class _WholeBatchNorm(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float,
                eps: float, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var, count = whole_batch_moments(x, group)
        if count <= 1 and running_var is not None:
            raise ValueError(f"batch norm in training needs more than 1 value per channel over the whole batch "
                             f"(got {count}), as torch's own check says")
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        compute = _compute_dtype(x)
        invstd = torch.rsqrt(var + eps).to(compute)
        mean_c = mean.to(compute)
        xhat = (x.to(compute) - mean_c.view(_shape(x))) * invstd.view(_shape(x))
        y = xhat
        if weight is not None:
            y = y * weight.to(compute).view(_shape(x))
        if bias is not None:
            y = y + bias.to(compute).view(_shape(x))
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.group, ctx.has_bias = count, group, bias is not None
        ctx.mark_non_differentiable(mean_c, invstd)
        return y.to(x.dtype), mean_c, invstd

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _mean: Any, _invstd: Any) -> tuple:
        xhat, invstd, weight = ctx.saved_tensors
        g = grad.to(xhat.dtype)
        dims = _dims(xhat)
        sums = torch.stack([g.sum(dims), (g * xhat).sum(dims)])  # this replica's sum(g), sum(g * xhat)
        local_dy, local_dy_xhat = sums[0].clone(), sums[1].clone()
        dist.all_reduce(sums, group=ctx.group)
        shape = _shape(xhat)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            n = float(max(ctx.count, 1))
            grad_x = (scale.view(shape) * (g - (sums[0] / n).view(shape) - xhat * (sums[1] / n).view(shape)))
            grad_x = grad_x.to(grad.dtype)
        grad_w = local_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = local_dy.to(grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _whole(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: Optional[float],
           eps: float, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if momentum is None:
        raise ValueError("batch norm with momentum=None (a cumulative average over the steps) cannot be made "
                         "whole across data-parallel replicas here; give the layer a momentum, or pass "
                         "batch_statistics='local'")
    return _WholeBatchNorm.apply(x, weight, bias, running_mean, running_var, float(momentum), float(eps), group)


def _alone(group: Any) -> bool:
    return group is None or dist.get_world_size(group) == 1


def batch_norm(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
               momentum: Optional[float], eps: float, cudnn_enabled: bool = True, *, group: Any) -> torch.Tensor:
    """`aten.batch_norm.default` with the whole batch's statistics in training; `group` is this
    device's data-parallel replicas."""
    if not training or _alone(group):
        return torch.ops.aten.batch_norm.default(input, weight, bias, running_mean, running_var, training, momentum,
                                                 eps, cudnn_enabled)
    return _whole(input, weight, bias, running_mean, running_var, momentum, eps, group)[0]


def native_batch_norm(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                      running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
                      momentum: float, eps: float, *, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`aten.native_batch_norm` / `aten._native_batch_norm_legit` (output, batch mean, inverse std)
    with the whole batch's statistics in training."""
    if not training or _alone(group):
        return torch.ops.aten.native_batch_norm.default(input, weight, bias, running_mean, running_var, training,
                                                        momentum, eps)
    return _whole(input, weight, bias, running_mean, running_var, momentum, eps, group)


def native_batch_norm_no_stats(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                               training: bool, momentum: float, eps: float, *,
                               group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`aten._native_batch_norm_legit.no_stats` (no running statistics) over the whole batch."""
    if _alone(group):
        return torch.ops.aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return _whole(input, weight, bias, None, None, momentum, eps, group)


#: The op each kernel replaces (by the op's name, as the rule table keys ops).
KERNELS = {"aten.batch_norm.default": batch_norm, "aten.native_batch_norm.default": native_batch_norm,
           "aten._native_batch_norm_legit.default": native_batch_norm,
           "aten._native_batch_norm_legit.no_stats": native_batch_norm_no_stats}
