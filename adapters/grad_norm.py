"""The global gradient norm of a ParallelModule's `.grad`s, and clipping by it.

Framework clipping (`torch.nn.utils.clip_grad_norm_` inside Lightning's precision plugin or the
Hugging Face Trainer) only sees this rank's shards, so its norm is wrong under any plan that splits
or pipelines parameters. The counting rule is the runtime's (`runtime/grad_clip.py`, which
`nns.build_optimizer`'s `clip_grad_norm_` uses too): of the devices holding the same piece, and of
a tied weight's copies, only one counts it, and reduced gradients, equal on every replica, count
on the first replica only. ZeRO-2/3 plans keep gradients outside `.grad`; their clipping is the
plan's optimizer's `clip_grad_norm_`, which the adapters call instead (ZeRO-2 without that optimizer
keeps whole gradients in `.grad`, as stage 1 does, and is clipped here).
"""
from __future__ import annotations

from typing import Any

import torch

from nnscaler_plugins.runtime.grad_clip import clip_, global_norm


def _gradients(module: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the gradients this rank counts in the norm, every gradient it holds)."""
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
        if module.dp_rank == 0 and module.counts_in_norm(key):
            counted.append(g)
    return counted, held


def global_grad_norm(module: Any, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the logical model (collective: every rank calls it)."""
    counted, held = _gradients(module)
    device = held[0].device if held else torch.device("cpu")
    return global_norm(counted, norm_type, device)


def clip_grad_norm_(module: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every held gradient so the global norm is at most `max_norm`; returns the norm before
    clipping, like `torch.nn.utils.clip_grad_norm_`."""
    counted, held = _gradients(module)
    device = held[0].device if held else torch.device("cpu")
    norm = global_norm(counted, norm_type, device)
    with torch.no_grad():
        clip_(held, norm, float(max_norm))
    return norm
