"""The global gradient norm of a parallel module, each parameter counted once.

A parameter's gradient may be split across tensor-parallel devices, held whole by several of them,
live on one pipeline stage (or as tied copies on two), and be cut into ZeRO chunks across the
data-parallel replicas. Each rank adds up only the pieces it is the counting holder of (its ZeRO
chunk, or for unsharded gradients the first replica's copy, and of identical copies inside a unit
only the first device's), then one all-reduce over the world gives what
`torch.nn.utils.clip_grad_norm_` computes on one device.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from ..lowering import Program



def counts_in_norm(program: Program, key: str, unit_device: int) -> bool:
    """Whether `unit_device`'s copy of shard `key` counts in a global gradient norm: of the unit
    devices (and tied copies) holding the same piece, only the first does."""
    s = program.shards[key]
    if s.tied and key != min(k for k, o in program.shards.items() if o.fqn == s.fqn):
        return False
    lay = s.layout
    mine = lay.digits(lay.position_of(unit_device))[1:]
    same = [d for d in lay.group if lay.digits(lay.position_of(d))[1:] == mine]
    return unit_device == min(same)


def global_norm(counted: Iterable[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm over every rank's `counted` gradients (collective over the world)."""
    norm_type = float(norm_type)
    grads = [g for g in counted if g.numel()]
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else \
            torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        local = sum((torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads),
                    torch.zeros((), device=device))
        op = dist.ReduceOp.SUM
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=op)
    return local if math.isinf(norm_type) else local ** (1.0 / norm_type)


def clip_(grads: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place as torch.nn.utils.clip_grad_norm_ does (coefficient clamped at 1)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
