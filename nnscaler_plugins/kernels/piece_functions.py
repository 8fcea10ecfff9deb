"""What a piece of a split op runs when it is not the op itself.

Each function takes the piece's local tensors plus the facts it needs about its place among the
pieces (a vocabulary offset, a scale, a process group). Generated code imports this module by
its path and calls these by name; the op rules (`rules/`) choose them in a `Localized`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

aten = torch.ops.aten


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """Lookup in rows [start, start + rows) of the vocabulary; other ids give zero rows, so the
    pieces' outputs add up to the whole embedding."""
    rows = weight.shape[0]
    inside = (ids >= start) & (ids < start + rows)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    out = aten.embedding.default(weight, local, pad, scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)


def scaled_mean(x: torch.Tensor, dims: Any, keepdim: bool = False, factor: float = 1.0,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A mean over a split dim as a partial sum: the local mean times local/global count."""
    return aten.mean.dim(x, dims, keepdim, dtype=dtype) * factor


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, reduction, ignore_index, group):
        # logits: [N, C_local] (class dim last after the caller's permute)
        x = logits.float()
        m = x.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        s = e.sum(dim=-1)
        dist.all_reduce(s, group=group)
        rows = x.shape[-1]
        valid = target != ignore_index
        inside = (target >= start) & (target < start + rows) & valid
        local_t = torch.where(inside, target - start, torch.zeros_like(target))
        picked = torch.gather(x, -1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        dist.all_reduce(picked, group=group)
        loss = (torch.log(s) + m - picked) * valid
        count = valid.sum()
        ctx.save_for_backward(e, s, local_t, inside, valid)
        ctx.reduction, ctx.count, ctx.dtype = reduction, count, logits.dtype
        if reduction == 1:
            return (loss.sum() / count).to(logits.dtype)
        if reduction == 2:
            return loss.sum().to(logits.dtype)
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        e, s, local_t, inside, valid = ctx.saved_tensors
        g = e / s.unsqueeze(-1)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        g = g * valid.unsqueeze(-1)
        if ctx.reduction == 1:
            g = g * (grad.float() / ctx.count)
        elif ctx.reduction == 2:
            g = g * grad.float()
        else:
            g = g * grad.float().unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, reduction: int = 1,
                                 ignore_index: int = -100, group: Any = None) -> torch.Tensor:
    """Cross-entropy over a class dim split across `group`: max, sum of exponentials and the
    target logit are all-reduced; the gradient is computed locally. Every piece returns the
    whole loss."""
    if logits.ndim > 2:  # [N, C, d1, ...] -> [N * d1 * ..., C]
        c = logits.shape[1]
        logits = logits.movedim(1, -1).reshape(-1, c)
        shape = target.shape
        target = target.reshape(-1)
        out = _VocabParallelCE.apply(logits, target, start, reduction, ignore_index, group)
        return out.reshape(shape) if reduction == 0 else out
    return _VocabParallelCE.apply(logits, target, start, reduction, ignore_index, group)


def batch_split_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                                   reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0,
                                   group: Any = None) -> torch.Tensor:
    """A mean cross-entropy over a batch split across `group`, as a partial sum: local sum divided
    by the global number of counted targets (their weights, when class weights are given)."""
    local = aten.cross_entropy_loss.default(logits, target, weight, 2, ignore_index, label_smoothing)
    valid = (target != ignore_index)
    if weight is not None:
        count = (weight[torch.where(valid, target, torch.zeros_like(target))] * valid).sum().detach()
    else:
        count = valid.sum().to(logits.dtype)
    if group is not None:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return local / count
