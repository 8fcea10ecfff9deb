"""The global gradient norm of a ParallelModule, and clipping by it.

Framework clipping (`torch.nn.utils.clip_grad_norm_` inside Lightning's precision plugin or the
Hugging Face Trainer) only sees this rank's shards, so its norm is wrong under any plan that splits
or pipelines parameters. Here each rank adds the squares of the gradients it holds, weighted so that
every element of the logical model counts exactly once (replicated pieces and the copies of a tied
weight are shared out), and one all-reduce gives the norm one device would compute.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist


def _held_gradients(module: Any) -> list[tuple[torch.Tensor, float]]:
    """(gradient, weight) for each parameter shard this rank holds: weight = 1 / copies of it."""
    program = module.program
    copies_of_name = Counter(s.fqn for s in program.shards.values() if s.kind == "param")
    out = []
    for key in module._held:
        s = program.shards[key]
        if s.kind != "param":
            continue
        p = module._local(key)
        if p.grad is None:
            continue
        lay = s.layout
        split = 1
        for n in lay.splits:
            split *= n
        same_piece = len(lay.group) // split  # devices of the unit holding this very piece
        out.append((p.grad, 1.0 / (same_piece * copies_of_name[s.fqn])))
    return out


def global_grad_norm(module: Any, norm_type: float = 2.0) -> torch.Tensor:
    """The 2-norm of all gradients of the logical model (collective: every rank calls it)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"only the 2-norm is supported for plan-aware clipping, got norm_type={norm_type}")
    grads = _held_gradients(module)
    device = grads[0][0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in grads:
        total += g.detach().double().pow(2).sum() * w
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Replicas hold equal (already averaged) gradients: the sum over the world counts each dp times.
        dist.all_reduce(total)
        total /= module.dp_size
    return total.sqrt().float()


def clip_grad_norm_(module: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every held gradient so the global norm is at most `max_norm`; returns the norm before
    clipping, like `torch.nn.utils.clip_grad_norm_`."""
    norm = global_grad_norm(module, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g, _ in _held_gradients(module):
        g.detach().mul_(coef.to(g.device, g.dtype))
    return norm
