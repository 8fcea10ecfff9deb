"""DeepSpeed's checkpoint layout: `save_dir/latest` names the tag, `save_dir/<tag>/` holds the files.

Inside a tag directory (file names as DeepSpeed's, contents this engine's):
    mp_rank_00_model_states.pt      whole weights under the model's own names ("module"), the engine's
                                    counters, the scheduler, and the caller's client_state keys at the
                                    top level, as DeepSpeed keeps them
    zero_pp_rank_{d}_mp_rank_{u:02d}_optim_states.pt
                                    the optimizer state of data-parallel rank d, unit device u
Whole weights load under any plan or world size; optimizer state needs the plan it was saved under.
Every rank must call save and load (the weights are gathered collectively).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

MODEL_FILE = "mp_rank_00_model_states.pt"
LATEST = "latest"
# Keys of the model-states file that belong to the engine; the rest is the caller's client_state.
ENGINE_KEYS = ("module", "global_steps", "global_samples", "micro_steps", "skipped_steps", "lr_scheduler",
               "ds_config", "ds_version", "nnscaler_plan", "dp_world_size", "mp_world_size")


def optim_file(dp_rank: int, unit_device: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{unit_device:02d}_optim_states.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(save_dir: str, tag: str, model_states: dict, optim_states: Optional[dict], dp_rank: int, unit_device: int,
         save_latest: bool) -> str:
    """Write this rank's files; rank 0 writes the model states and, after everyone is done, `latest`."""
    path = os.path.join(save_dir, str(tag))
    os.makedirs(path, exist_ok=True)
    if _rank() == 0:
        _atomic_save(model_states, os.path.join(path, MODEL_FILE))
    if optim_states is not None:
        _atomic_save(optim_states, os.path.join(path, optim_file(dp_rank, unit_device)))
    _barrier()
    if save_latest and _rank() == 0:
        with open(os.path.join(save_dir, LATEST + ".tmp"), "w") as f:
            f.write(str(tag))
        os.replace(os.path.join(save_dir, LATEST + ".tmp"), os.path.join(save_dir, LATEST))
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


def read_model_states(path: str) -> dict:
    file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: {path!r} is not a checkpoint written by save_checkpoint "
                                "(pass the directory that holds 'latest', and optionally the tag)")
    return torch.load(file, map_location="cpu", weights_only=False)


def read_optim_states(path: str, dp_rank: int, unit_device: int) -> dict:
    file = os.path.join(path, optim_file(dp_rank, unit_device))
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: the checkpoint was saved with fewer ranks or another plan; "
                                "load it with load_optimizer_states=False (weights only) or under the plan it was "
                                "saved with")
    return torch.load(file, map_location="cpu", weights_only=False)


def client_state_of(model_states: dict) -> dict:
    return {k: v for k, v in model_states.items() if k not in ENGINE_KEYS}
