"""DeepSpeed's checkpoint layout, written by this engine.

    save_dir/latest                                   the newest tag (DeepSpeed's, read by HF's resume too)
    save_dir/<tag>/mp_rank_00_model_states.pt         whole module state in the training dtype, the
                                                      engine's counters, scheduler, client_state keys
    save_dir/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt   the same, per data-parallel rank (ZeRO-3)
    save_dir/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
                                                      rank r's partition of the fp32 master weights in
                                                      DeepSpeed's flat layout (ZeRO >= 1 or bf16)
    save_dir/<tag>/nnscaler/                          one `nns.checkpoint` directory: every tensor and the
                                                      optimizer state, loadable under any plan or world size

The DeepSpeed files are what DeepSpeed's own tools read (`zero_to_fp32`'s
`get_fp32_state_dict_from_zero_checkpoint`, HF's resume); this engine loads from the `nnscaler`
directory, so a job may resume under another plan or world size. A checkpoint saved before the
model was parallelized has no `nnscaler` directory (there is no optimizer state yet): it loads from
the module state.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist

import nnscaler_plugins.checkpoint as nns_checkpoint

from . import utils  # noqa: F401 - deepspeed.checkpoint.utils, as scripts reach it

LATEST = "latest"
NNS_DIR = "nnscaler"
DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout these files follow


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


def _flat_partition_zero2(tensors: list[torch.Tensor], dp: int, dp_rank: int) -> torch.Tensor:
    """Rank `dp_rank`'s slice of the group's fp32 tensors laid end to end, padded to 2 x dp as
    DeepSpeed's ZeRO-1/2 aligns its flat buffers."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
    align = 2 * dp
    padded = align * math.ceil(flat.numel() / align) if flat.numel() else 0
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    part = padded // dp
    return flat[dp_rank * part:(dp_rank + 1) * part].clone()


def _flat_partition_zero3(tensors: list[torch.Tensor], dp: int, dp_rank: int) -> torch.Tensor:
    """ZeRO-3's layout: each tensor padded to a multiple of dp, rank `dp_rank`'s chunk of each."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1).float()
        size = math.ceil(flat.numel() / dp)
        flat = torch.cat([flat, flat.new_zeros(size * dp - flat.numel())])
        parts.append(flat[dp_rank * size:(dp_rank + 1) * size])
    return torch.cat(parts).clone() if parts else torch.zeros(0)


def save(save_dir: str, tag: str, *, module_state: dict[str, torch.Tensor], buffer_names: list[str],
         groups: list[list[str]], masters: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
         shared: dict[str, str], extra: dict[str, Any], zero_stage: int, precision: str, dp: int, dp_rank: int,
         parallel: Any = None, optimizer: Any = None, save_latest: bool = True) -> str:
    """Write `save_dir/<tag>` (every rank calls it) and then, on rank 0, point `latest` at it.

    `groups` names the trainable parameters of each optimizer group, `masters` their fp32 values,
    `shared` each tied parameter's other names (name -> the name it is stored under);
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
              "ds_version": DS_VERSION, **extra}
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
        stage = max(zero_stage, 1)
        split = _flat_partition_zero3 if stage >= 3 else _flat_partition_zero2
        flats = [split([masters[n] for n in names], dp, dp_rank) for names in groups]
        key = "fp32_flat_groups" if stage >= 3 else "single_partition_of_fp32_groups"
        torch.save({"optimizer_state_dict": {"zero_stage": stage, "partition_count": dp, key: flats},
                    "ds_config": extra.get("ds_config"), "ds_version": DS_VERSION},
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
