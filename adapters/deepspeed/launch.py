"""How a DeepSpeed script starts: its argument parser and its process group.

Scripts are launched by `deepspeed`, by `torchrun`, or as plain `python script.py`. The first two
set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; without them this is a single-process job, which
gets a one-process group (no port, no MPI discovery) so that `torch.distributed` calls in the script
still work.
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.runtime.job_store import init_default_group

from nnscaler_plugins.plugins import get_plugin_manager


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's argument group: --deepspeed, --deepspeed_config and their deprecated spellings.
    Like DeepSpeed's, it does not add --local_rank (scripts add it themselves)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def default_backend() -> str:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return get_plugin_manager().hook.nnscaler_choose_backend(device_type=device_type)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30), init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialize torch.distributed as `deepspeed.init_distributed` would, when it is not yet.

    The backend defaults to the `nnscaler_choose_backend` hook's choice (NCCL on GPUs, gloo on CPU).
    MPI discovery is not attempted: without launcher variables the job is one process.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialized; initialize it "
                           "first or leave dist_init_required out")
    backend = dist_backend or default_backend()
    env = os.environ
    if rank >= 0 and world_size > 0:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(distributed_port))
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    elif "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(distributed_port))
        if init_method in (None, "env://"):  # on a store view of this restart attempt, as nns.parallelize does
            init_default_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
