"""The global gradient norm of a ParallelModule, as DeepSpeed's `gradient_clipping` needs it.

The norm itself is the adapters' shared plan-aware one (`adapters/grad_norm.py`: every element of
the logical model counted once, whatever the plan splits, replicates or ties); DeepSpeed reports it
as a float and clips with its own rule.
"""
from __future__ import annotations

from typing import Any

import torch

from ..grad_norm import global_grad_norm as _plan_norm


def global_grad_norm(module: Any) -> float:
    """The 2-norm of all gradients of the whole model (collective: every rank calls it)."""
    return float(_plan_norm(module))


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
