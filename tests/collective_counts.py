"""Counting the all-to-alls a step sends (the plan's expert exchanges) in a worker process:
torch.distributed's `all_to_all_single` is wrapped for the length of a `with` block, and the real
function runs every call. A reduce-scatter on gloo is an all-to-all too (kernels/reduce_scatter.py);
those are not counted."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.distributed as dist

_REDUCE_SCATTER = "nnscaler_plugins.kernels.reduce_scatter"


@contextlib.contextmanager
def all_to_alls() -> Iterator[dict]:
    """{"all": calls, "async": those started with async_op=True}, counted while the block runs."""
    counts = {"all": 0, "async": 0}
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") != _REDUCE_SCATTER:
            counts["all"] += 1
            counts["async"] += bool(kwargs.get("async_op"))
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        yield counts
    finally:
        dist.all_to_all_single = real
