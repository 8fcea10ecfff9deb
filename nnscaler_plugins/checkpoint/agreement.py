"""Collective calls that fail with a message instead of hanging when some rank never arrives.

Every rank posts a value under a key of the default process group's store and waits, with a
timeout, for every other rank's key. A collective such as a barrier would block forever on a rank
that skipped the call (the classic "save_checkpoint hangs when only rank 0 calls it"); the store
wait names the missing ranks instead. Keys are numbered per process: a round that timed out
withdraws this rank's key and does not advance the number, so a rank that skipped a save and the
ranks that waited for it still agree on the next round's number. Keys belong to the launcher's
attempt (runtime/job_store.py): a job restarted by torchrun starts its rounds afresh.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import torch.distributed as dist

from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.runtime.job_store import job_store, key

_round = {"n": 0}


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def begin_round() -> int:
    return _round["n"]


def exchange(round_no: int, phase: str, value: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's `value` for this round and phase, in rank order; CheckpointError naming the
    ranks that did not arrive within `timeout_s`."""
    rank, size = world()
    if size == 1:
        return [value]
    store = job_store()
    keys = [key("checkpoint", round_no, phase, r) for r in range(size)]
    store.set(keys[rank], pickle.dumps(value))
    if not _arrived(store, keys, timeout_s):
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if phase == "begin":
            store.delete_key(keys[rank])  # withdrawn: a late rank will time out too, not proceed alone
        raise CheckpointError(
            f"{what} is collective: rank(s) {missing} did not call it within {timeout_s:g} s (rank {rank} "
            f"waited). Call it on every rank at the same point of training (not only on rank 0); "
            f"raise sync_timeout_s if some ranks are just slower.") from None
    return [pickle.loads(store.get(k)) for k in keys]


def _arrived(store: Any, keys: list[str], timeout_s: float) -> bool:
    """Whether every key is set within the timeout. Polled with `check` rather than a timed
    `store.wait`, which logs socket warnings on every timeout."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def finish_round() -> None:
    _round["n"] += 1
