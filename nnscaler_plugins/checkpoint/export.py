"""`export`: the model as one ordinary state dict file, or as a Hugging Face `save_pretrained`
directory, for use without nnscaler (inference, hubs, other trainers)."""
from __future__ import annotations

import os
import secrets
import shutil
from typing import Any, Optional

import torch

from nnscaler_plugins.checkpoint.agreement import (
    begin_round,
    exchange,
    finish_round,
    world,
)
from nnscaler_plugins.checkpoint.atomic import (
    fsync_dir,
    fsync_file,
    sibling,
    swap_into_place,
)
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.model_state import full_model_state

WHAT = "nns.checkpoint.export"


def write_state_dict_file(state: dict[str, torch.Tensor], path: str) -> None:
    """torch.save to a temporary sibling, synced, then renamed over `path` (never half a file)."""
    tmp = sibling(path, "saving", secrets.token_hex(6))
    try:
        torch.save(state, tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path))


def _check_hf(hf_model: Any, state: dict[str, torch.Tensor]) -> None:
    if not hasattr(hf_model, "save_pretrained") or not hasattr(hf_model, "config"):
        raise CheckpointError(f"{WHAT}: hf_model must be a Hugging Face PreTrainedModel (the model you parallelized, "
                              f"for its config and class); got {type(hf_model).__name__}")
    theirs = set(hf_model.state_dict())
    missing, unexpected = sorted(theirs - set(state)), sorted(set(state) - theirs)
    if missing or unexpected:
        raise CheckpointError(f"{WHAT}: the module's tensors do not match hf_model's: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}; pass the model this module was made from")


def export(path: str | os.PathLike, module: torch.nn.Module, *, hf_model: Any = None,
           sync_timeout_s: float = 600.0) -> str:
    """Write the whole model once (collective: call on every rank; rank 0 writes).

    Without `hf_model`: one torch.save file holding an ordinary state dict (model.load_state_dict
    takes it). With `hf_model` (the Hugging Face model the module was made from, for its config
    and class): a `save_pretrained` directory that `from_pretrained` loads with these weights.
    """
    rank, _ = world()
    final = os.path.abspath(os.fspath(path))
    round_no = begin_round()
    begun = exchange(round_no, "begin-export", final, sync_timeout_s, WHAT)
    finish_round()
    if len(set(begun)) > 1:
        raise CheckpointError(f"{WHAT}: ranks passed different paths {sorted(set(begun))}; pass the same path")
    state = full_model_state(module)
    if hf_model is not None:
        _check_hf(hf_model, state)
    status = "ok"
    if rank == 0:
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if hf_model is None:
                write_state_dict_file(state, final)
            else:
                _save_pretrained(hf_model, state, final)
        except Exception as e:  # noqa: BLE001 - told to every rank
            status = f"{type(e).__name__}: {e}"
    done = exchange(round_no, "done-export", status, sync_timeout_s, WHAT)
    if done[0] != "ok":
        raise CheckpointError(f"{WHAT} to {final} failed on rank 0: {done[0]}")
    return final


def _save_pretrained(hf_model: Any, state: dict[str, torch.Tensor], final: str) -> None:
    token = secrets.token_hex(6)
    tmp = sibling(final, "saving", token)
    try:
        hf_model.save_pretrained(tmp, state_dict={k: v.contiguous() for k, v in state.items()})
        for name in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, name)):
                fsync_file(os.path.join(tmp, name))
        fsync_dir(tmp)
        swap_into_place(tmp, final, token)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def exported_state(path: str, device: Optional[str] = "cpu") -> dict[str, torch.Tensor]:
    """An exported state dict file read back (weights only)."""
    return torch.load(path, map_location=device, weights_only=True)
