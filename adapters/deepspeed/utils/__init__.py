"""What scripts use of `deepspeed.utils`: the accessors of whole tensors behind a parameter,
`safe_get_full_grad`, `safe_set_full_grad` and `safe_get_full_fp32_param`, `RepeatingLoader`,
`logger` / `log_dist`, and the submodules `zero_to_fp32` (whole fp32 weights from a checkpoint)
and `torch` (`required_torch_version`), `module_utils` (`recursive_getattr` / `recursive_setattr`).

DeepSpeed scripts pass the parameters they took from the engine or the model; each is traced to
the engine training it. Under ZeRO DeepSpeed gathers the pieces; so do these where a piece is not
the whole tensor (collective then: every rank calls them, as in DeepSpeed).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..zero import engine_of
from . import module_utils  # noqa: F401 - deepspeed.utils.module_utils

logger = logging.getLogger("nnscaler_plugins.deepspeed")


def log_dist(message: str, ranks: Optional[list] = None, level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks (all when None or containing -1), as DeepSpeed's does."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def _engine(param: torch.Tensor):
    engine = engine_of(param)
    if engine is None:
        raise ValueError("this tensor is not a parameter of a model an engine trains (pass one from "
                         "engine.parameters() or from the model given to initialize)")
    return engine


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole gradient of `param` as this rank holds it (None before a backward)."""
    return _engine(param).full_grad(param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make `value`, the whole gradient of `param`, the one the next optimizer step uses (call it
    after backward, on every rank, as in DeepSpeed)."""
    _engine(param).set_full_grad(param, value)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 value of `param` (the master weight in bf16/fp16)."""
    return _engine(param).full_fp32_param(param)


class RepeatingLoader:
    """DeepSpeed's `RepeatingLoader`: iterate `loader` forever, starting it over at its end."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
