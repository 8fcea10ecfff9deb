"""The global gradient norm of a parallel module, each parameter counted once, and clipping by it.

The one counting rule, used by `nns.build_optimizer`'s `clip_grad_norm_` and by the adapters
(Lightning, the Hugging Face Trainer and the DeepSpeed engine clip through this module when the
framework's own optimizer steps the module's `.grad`s):

A parameter's gradient may be split across tensor-parallel devices, held whole by several of them,
live on one pipeline stage (or as tied copies on two), and be cut into ZeRO chunks across the
data-parallel replicas. Each rank adds up only the pieces it is the counting holder of: of the
unit devices (and tied copies) holding the same piece only the first (`counts_in_norm`), and of a
gradient every replica holds whole only the first replica's copy (`counts`); a ZeRO chunk counts
on the replica that owns it. One all-reduce over the world then gives what
`torch.nn.utils.clip_grad_norm_` computes on one device.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


# -- the counting rule ------------------------------------------------------------------------------
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


def counts(in_unit: bool, whole_on_every_replica: bool, dp_rank: int) -> bool:
    """Whether this rank counts a gradient: it is the unit's counting holder (`counts_in_norm`)
    and, when every replica holds the gradient whole, this is the first replica."""
    return in_unit and (dp_rank == 0 or not whole_on_every_replica)


# -- the norm and clipping ----------------------------------------------------------------------------
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


# -- a ParallelModule's `.grad`s (the frameworks' own optimizers) -------------------------------------
# ZeRO-2/3 plans keep gradients outside `.grad`; their clipping is the plan's optimizer's
# `clip_grad_norm_`, which the adapters call instead (ZeRO-2 without that optimizer keeps whole
# gradients in `.grad`, as stage 1 does, and is clipped here).
def module_gradients(module: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the `.grad`s this rank counts in the norm, every `.grad` it holds) of a ParallelModule."""
    plan = module.plan
    if plan.zero >= 2 and plan.dp > 1 and (plan.zero >= 3 or getattr(module, "sharded_optimizer", True)):
        raise RuntimeError(f"zero={plan.zero} keeps gradients as ZeRO chunks: clip with the optimizer "
                           "nns.build_optimizer made (its clip_grad_norm_)")
    counted, held = [], []
    for key in module.held_keys:
        s = module.program.shards[key]
        if s.kind != "param":
            continue
        g = module.local_tensor(key).grad
        if g is None:
            continue
        held.append(g)
        if counts(module.counts_in_norm(key), True, module.dp_rank):
            counted.append(g)
    return counted, held


def grad_norm(module: Any, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the logical model (collective: every rank calls it)."""
    counted, held = module_gradients(module)
    device = held[0].device if held else torch.device("cpu")
    return global_norm(counted, norm_type, device)


def clip_grad_norm_(module: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every held gradient so the global norm is at most `max_norm`; returns the norm before
    clipping, like `torch.nn.utils.clip_grad_norm_` (collective: every rank calls it)."""
    counted, held = module_gradients(module)
    device = held[0].device if held else torch.device("cpu")
    norm = global_norm(counted, norm_type, device)
    with torch.no_grad():
        clip_(held, norm, float(max_norm))
    return norm


def clip_by_norm_(module: Any, max_norm: float, norm: float) -> None:
    """DeepSpeed's form, the norm already known (a float, from `grad_norm`): scale every gradient
    of `module.parameters()` by max_norm / (norm + 1e-6) when that is below 1."""
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0:
        return
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
