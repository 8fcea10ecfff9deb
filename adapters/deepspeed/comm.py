"""`deepspeed.comm` (`import deepspeed.comm as dist`): DeepSpeed's collectives, on torch.distributed.

DeepSpeed's module mirrors torch.distributed's functions (with extra keywords for its own
communication logger: `log_name`, `prof`, `debug`, accepted and ignored here) and adds a few
helpers (`get_local_rank`, `get_world_group`, `get_all_ranks_from_group`, `init_distributed`).
Every other name is torch.distributed's.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch.distributed as _td

from .launch import init_distributed

ReduceOp = _td.ReduceOp
_LOGGER_KEYWORDS = ("log_name", "prof", "debug")


def _plain(fn: Callable) -> Callable:
    """torch.distributed's `fn`, taking (and dropping) DeepSpeed's logger keywords."""

    def call(*args: Any, **kwargs: Any) -> Any:
        for k in _LOGGER_KEYWORDS:
            kwargs.pop(k, None)
        return fn(*args, **kwargs)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


is_initialized = _td.is_initialized
is_available = _td.is_available
destroy_process_group = _td.destroy_process_group
new_group = _td.new_group
get_rank = _td.get_rank
get_world_size = _td.get_world_size
broadcast = _plain(_td.broadcast)
broadcast_object_list = _plain(_td.broadcast_object_list)
all_gather = _plain(_td.all_gather)
all_gather_object = _plain(_td.all_gather_object)
all_gather_into_tensor = _plain(_td.all_gather_into_tensor)
reduce_scatter_tensor = _plain(_td.reduce_scatter_tensor)
reduce_scatter = _plain(_td.reduce_scatter)
all_to_all_single = _plain(_td.all_to_all_single)
all_to_all = _plain(_td.all_to_all)
all_reduce = _plain(_td.all_reduce)
inference_all_reduce = _plain(_td.all_reduce)
reduce = _plain(_td.reduce)
send = _plain(_td.send)
recv = _plain(_td.recv)
isend = _plain(_td.isend)
irecv = _plain(_td.irecv)
batch_isend_irecv = _plain(_td.batch_isend_irecv)
gather = _plain(_td.gather)
scatter = _plain(_td.scatter)
barrier = _plain(_td.barrier)
monitored_barrier = _plain(_td.monitored_barrier)


def get_world_group() -> Any:
    return _td.group.WORLD


def get_local_rank() -> int:
    """The process's device index on its node (the launcher's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Optional[Any] = None, group_rank: int = 0) -> int:
    return group_rank if group is None else _td.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Optional[Any] = None) -> list:
    if group is None:
        return list(range(_td.get_world_size()))
    return _td.get_process_group_ranks(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def allgather_fn(output_tensor: Any, input_tensor: Any, group: Optional[Any] = None, async_op: bool = False,
                 debug: Any = None) -> Any:
    return _td.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Optional[Any] = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    return _td.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict]:
    """DeepSpeed's communication logger summary: nothing is logged here."""
    return {} if return_dict else None


def configure(deepspeed_config: Any = None, enabled: Any = None, prof_all: Any = None, prof_ops: Any = None,
              verbose: Any = None, debug: Any = None) -> None:
    """DeepSpeed's communication-logger settings: accepted, nothing is logged here."""


__all__ = ["init_distributed", "ReduceOp", "is_initialized", "is_available", "destroy_process_group", "new_group",
           "get_rank", "get_world_size", "get_local_rank", "get_world_group", "get_global_rank",
           "get_all_ranks_from_group", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
           "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all",
           "all_reduce", "inference_all_reduce", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv",
           "gather", "scatter", "barrier", "monitored_barrier", "allgather_fn", "reduce_scatter_fn",
           "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "log_summary", "configure"]
