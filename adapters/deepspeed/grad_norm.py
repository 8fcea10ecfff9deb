"""The global gradient norm of a ParallelModule, as DeepSpeed's `gradient_clipping` needs it.

Each rank holds pieces of some parameters and whole copies of others. The norm of the model's
gradient counts every element once: a piece's squares are summed over the devices that split the
parameter, a copy replicated on r devices of the unit (or a tied weight's k copies) contributes 1/r
(1/k) from each, and the sums meet in one all-reduce over the unit's devices. Data-parallel replicas
hold the same reduced gradients, so they need no communication.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist


def global_grad_norm(module: Any) -> float:
    """The 2-norm of all gradients of the whole model (collective over the module's unit)."""
    program = module.program
    copies = Counter(s.fqn for s in program.shards.values() if s.kind == "param")
    total = torch.zeros((), dtype=torch.float64)
    for v in module._held:
        s = program.shards[v]
        if s.kind != "param":
            continue
        p = module._local(v)
        if p.grad is None:
            continue
        weight = 1.0 / (s.layout.replicas * s.layout.partial * copies[s.fqn])
        total += p.grad.detach().double().pow(2).sum().cpu() * weight
    unit = module.plan.unit_size
    if unit > 1:
        group = module.groups.get(tuple(module.dp_rank * unit + d for d in range(unit)))
        dist.all_reduce(total, group=group)
    return float(total.sqrt())


def clip_gradients(module: Any, max_norm: float, norm: float) -> None:
    """Scale every gradient by max_norm / (norm + 1e-6) when that is below 1 (torch's and
    DeepSpeed's rule)."""
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0:
        return
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
