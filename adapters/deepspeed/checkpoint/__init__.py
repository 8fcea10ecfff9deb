"""DeepSpeed's checkpoint layout, written by this engine.

    save_dir/latest                                   the newest tag (DeepSpeed's, read by HF's resume too)
    save_dir/<tag>/mp_rank_00_model_states.pt         whole module state in the training dtype, the
                                                      engine's counters, scheduler, client_state keys
    save_dir/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt   the same, per data-parallel rank (ZeRO-3)
    save_dir/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
                                                      rank r's partition of the fp32 master weights and
                                                      of the optimizer's moments in DeepSpeed's flat
                                                      layout, with its slice mappings (optim_states.py;
                                                      ZeRO >= 1 or bf16)
    save_dir/<tag>/nnscaler/                          one `nns.checkpoint` directory: every tensor and the
                                                      optimizer state, loadable under any plan or world size

The DeepSpeed files are what DeepSpeed's own tools read (`zero_to_fp32`'s
`get_fp32_state_dict_from_zero_checkpoint`, `ds_to_universal`, HF's resume); this engine loads from the `nnscaler`
directory, so a job may resume under another plan or world size. A checkpoint saved before the
model was parallelized has no `nnscaler` directory (there is no optimizer state yet): it loads from
the module state.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist

import nnscaler_plugins.checkpoint as nns_checkpoint

from . import utils  # noqa: F401 - deepspeed.checkpoint.utils, as scripts reach it
from .optim_states import optimizer_state

LATEST = "latest"
NNS_DIR = "nnscaler"
DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout these files follow
# ds_to_universal requires this entry in the model states file (DeepSpeed's own engine writes it only
# when the model carries it, and its users pass --inject_missing_state otherwise); written here so
# the conversion runs as it is.
UNIVERSAL_INFO = "universal_checkpoint_info"
UNIVERSAL_VERSION = 0.2


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def model_file(zero_stage: int, dp_rank: int) -> str:
    if zero_stage >= 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt"


def optim_file(zero_stage: int, precision: str, dp_rank: int) -> str:
    prefix = "bf16_" if precision == "bf16" and zero_stage == 0 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def has_optim_files(zero_stage: int, precision: str) -> bool:
    """DeepSpeed writes partitioned fp32 masters under ZeRO and for its bf16 optimizer."""
    return zero_stage >= 1 or precision == "bf16"


def save(save_dir: str, tag: str, *, module_state: dict[str, torch.Tensor], buffer_names: list[str],
         groups: list[list[str]], masters: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
         shared: dict[str, str], extra: dict[str, Any], zero_stage: int, precision: str, dp: int, dp_rank: int,
         parallel: Any = None, optimizer: Any = None, save_latest: bool = True,
         moments: Optional[dict[str, dict]] = None, clip_grad: float = 0.0) -> str:
    """Write `save_dir/<tag>` (every rank calls it) and then, on rank 0, point `latest` at it.

    `groups` names the trainable parameters of each optimizer group, `masters` their fp32 values,
    `shared` each tied parameter's other names (name -> the name it is stored under), `moments`
    each trainable parameter's whole optimizer state (exp_avg, exp_avg_sq, step, ...) by name;
    `parallel` (the ParallelModule, when there is one) and `optimizer` go to the `nnscaler` directory."""
    path = os.path.join(save_dir, str(tag))
    if parallel is not None:
        nns_checkpoint.save(os.path.join(path, NNS_DIR), parallel, optimizer)
    os.makedirs(path, exist_ok=True)
    frozen_shapes = OrderedDict((n, t.shape) for n, t in frozen.items())
    param_shapes = [OrderedDict((n, masters[n].shape) for n in names) for names in groups]
    if zero_stage >= 3:  # ZeRO-3 readers join every rank's fragment and keep the first numel values
        frozen = {n: t.reshape(-1) for n, t in frozen.items()}
    states = {"module": module_state, "buffer_names": list(buffer_names), "param_shapes": param_shapes,
              "frozen_param_shapes": frozen_shapes,
              "frozen_param_fragments": frozen, "shared_params": dict(shared), "dp_world_size": dp, "mp_world_size": 1,
              "ds_version": DS_VERSION, UNIVERSAL_INFO: {"universal_checkpoint_version": UNIVERSAL_VERSION}, **extra}
    rank = _rank()
    if zero_stage >= 3:
        if rank == dp_rank:  # the first rank of each data-parallel replica
            mine = dict(states)
            if dp_rank != 0:  # the whole module once; the other files keep the buffers DeepSpeed reads
                mine["module"] = {k: v for k, v in module_state.items() if k in set(buffer_names)}
            torch.save(mine, os.path.join(path, model_file(zero_stage, dp_rank)))
    elif rank == 0:
        torch.save(states, os.path.join(path, model_file(zero_stage, 0)))
    if has_optim_files(zero_stage, precision) and rank == dp_rank:
        state = optimizer_state(groups, masters, moments, extra.get("param_groups"), zero_stage=zero_stage, dp=dp,
                                dp_rank=dp_rank, clip_grad=clip_grad)
        state["ds_version"] = DS_VERSION
        torch.save({"optimizer_state_dict": state, "ds_config": extra.get("ds_config"), "ds_version": DS_VERSION},
                   os.path.join(path, optim_file(zero_stage, precision, dp_rank)))
    _barrier()
    if save_latest and rank == 0:
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


def read_states(path: str) -> dict:
    """The module state and the engine's values saved with it (no optimizer tensors)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist (pass the directory that holds "
                                "'latest', and optionally the tag)")
    for name in (model_file(0, 0), model_file(3, 0)):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return torch.load(file, map_location="cpu", weights_only=False)
    raise FileNotFoundError(f"{path!r} holds no {model_file(0, 0)} (nor a ZeRO-3 model states file): not a "
                            "checkpoint this engine or DeepSpeed wrote")


def nns_dir(path: str) -> Optional[str]:
    d = os.path.join(path, NNS_DIR)
    return d if os.path.isdir(d) else None


def load_parallel(path: str, module: Any, optimizer: Any, strict: bool) -> None:
    """Weights (and optimizer state when `optimizer` is given) into `module` under its own plan."""
    nns_checkpoint.load(path, module, optimizer, strict=strict)
