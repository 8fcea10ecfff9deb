"""`deepspeed.runtime.utils`: the helpers scripts call."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("nnscaler_plugins.deepspeed")


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory report (rank 0, only with force=True): the device's allocated and peak bytes."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    if torch.cuda.is_available():
        log.info("%s | MA %.2f GB | Max_MA %.2f GB", message, torch.cuda.memory_allocated() / 2**30,
                 torch.cuda.max_memory_allocated() / 2**30)
    else:
        log.info("%s", message)
