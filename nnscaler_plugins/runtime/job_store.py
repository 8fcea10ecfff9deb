"""The job's key-value store (the default process group's), where ranks meet without a collective.

Checkpoint saves (checkpoint/agreement.py) and the watchdog (runtime/watchdog.py) post values under
keys of this store, because a collective would block where they must not: on a rank that never
arrives, or behind a hung collective.

A store must not outlive the attempt that wrote it. torchrun, by default, lets the workers share
its rendezvous store, which it keeps across restarts: the new processes of a restarted job then
read the keys the killed ones wrote (torch's own gloo and NCCL set-up reads stale peer addresses
too, pytorch/pytorch#135712). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in torchrun's environment
gives every attempt a store of its own; `launcher_advice` says so when a job runs without it.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch.distributed as dist

PREFIX = "nnscaler_plugins"


def job_store() -> Any:
    """The default process group's store (torch.distributed must be initialized)."""
    return dist.distributed_c10d._get_default_store()


def key(*parts: Any) -> str:
    """A store key of this library: `nnscaler_plugins/attempt<N>/<parts joined by />`, N the
    launcher's restart count (`TORCHELASTIC_RESTART_COUNT`, 0 outside torchrun). Where a restarted
    job still shares the killed attempt's store, its ranks never read a key the killed ones wrote: a
    watchdog position, a save's agreement, a heartbeat."""
    return "/".join([PREFIX, f"attempt{attempt()}", *(str(p) for p in parts)])


def attempt() -> int:
    """This process's restart attempt under torchrun (0 for the first, and outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def launcher_advice(environ: Mapping[str, str]) -> Optional[str]:
    """What to change in the launch (from the launcher's environment variables), or None: torchrun
    restarting workers that share its rendezvous store."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
                                                                      or 0) > 0:
        return ("torchrun restarts this job (--max-restarts) but its workers share the launcher's store, which keeps "
                "the killed workers' keys: a restarted job can read them and fail to connect or save. Launch with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment (a store per attempt; pytorch/pytorch#135712)")
    return None


def init_default_group(backend: str, **kwargs: Any) -> None:
    """`dist.init_process_group(backend)` from the launcher's environment (env://), on a view of the
    rendezvous store whose keys carry the restart attempt. Under torchrun with a static rendezvous
    (`--master_port`) a restarted job meets in the store the killed attempt used, which still holds
    the peers' addresses the killed processes published: gloo's set-up of the new default group reads
    them and fails to connect ("Connection refused"). Prefixed per attempt, the new group's set-up
    reads only what the new processes wrote."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = kwargs.pop("timeout", None)
    store, rank, world = next(dist.rendezvous("env://", rank, world, **({"timeout": timeout} if timeout else {})))
    store = dist.PrefixStore(f"{PREFIX}/attempt{attempt()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            **({"timeout": timeout} if timeout else {}), **kwargs)

