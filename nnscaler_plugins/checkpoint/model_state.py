"""Whole tensors of a model under its own names, from a ParallelModule or a plain nn.Module.

A ParallelModule's `full_state_dict` is the one definition of "whole tensor" under every plan
(tensor splits, pipeline stages, ZeRO), so checkpoints go through it rather than re-deriving
layouts here; a plain module (one process) is its own state dict.
"""
from __future__ import annotations

from typing import Any

import torch


def is_parallel(module: Any) -> bool:
    return hasattr(module, "full_state_dict") and hasattr(module, "load_full_state_dict")


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors (collective for a ParallelModule: call on every rank). Tied names map to the
    same tensor object, which the writer stores once."""
    if is_parallel(module):
        return module.full_state_dict()
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def expected_model_tensors(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The name and whole shape of every tensor a load must provide, known without communication."""
    program = getattr(module, "program", None)
    if is_parallel(module) and program is not None:
        out: dict[str, tuple[int, ...]] = {}
        for s in program.shards.values():
            if s.in_state_dict:
                for name in (s.fqn, *s.aliases):
                    out[name] = tuple(s.layout.shape)
        return out
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def load_model_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    if is_parallel(module):
        module.load_full_state_dict(state)
    else:
        module.load_state_dict(state)
