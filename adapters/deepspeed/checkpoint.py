"""DeepSpeed's checkpoint layout around this project's checkpoints.

    save_dir/latest        a text file naming the newest tag (DeepSpeed's, read by HF's resume too)
    save_dir/<tag>/        one `nns.checkpoint` directory (default tag `global_step{N}`): whole
                           tensors written by their owner ranks, so it loads under any plan or world
                           size; the engine's counters, the scheduler and the caller's client_state
                           travel as its extra values

Every rank must call save and load; `nns.checkpoint.save` names a rank that never called it
instead of hanging, which is DeepSpeed users' most common checkpoint failure.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist

import nnscaler_plugins.checkpoint as nns_checkpoint
from nnscaler_plugins.checkpoint.format import read_extra, read_metadata

LATEST = "latest"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(save_dir: str, tag: str, module: Any, optimizer: Any, extra: dict, save_latest: bool) -> str:
    """Write `save_dir/<tag>` and then, on rank 0, point `latest` at it."""
    path = nns_checkpoint.save(os.path.join(save_dir, str(tag)), module, optimizer, **extra)
    _barrier()
    if save_latest and (not dist.is_initialized() or dist.get_rank() == 0):
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(tag))
        os.replace(tmp, os.path.join(save_dir, LATEST))
    _barrier()
    return path


def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag to load: the given one, or the one `latest` names; None when there is none."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def read_extras(path: str) -> dict:
    """The extra values saved with the checkpoint, without loading any tensor (no module needed)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist (pass the directory that holds "
                                "'latest', and optionally the tag)")
    directory, meta = read_metadata(path)
    return read_extra(directory, meta)


def load(path: str, module: Any, optimizer: Any, strict: bool) -> dict:
    """Weights (and optimizer state when `optimizer` is given) into `module` under its own plan."""
    return nns_checkpoint.load(path, module, optimizer, strict=strict)
