"""What scripts use of `deepspeed.checkpoint.utils`: copies of state safe to hand to `torch.save`,
and the names of a checkpoint's files.

A state dict's tensors may be views into larger storage (a flat buffer, this rank's shard of one);
`torch.save` writes a view's whole storage, so a saved state dict can be many times its size.
Cloning each tensor first writes only what the state dict holds.
"""
from __future__ import annotations

import os
from typing import Any, Union

import torch


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = torch.device("cpu")) -> Any:
    """`item` with every tensor in it (nested in lists, tuples and dicts, which keep their types)
    replaced by a detached copy on `device`; anything else is returned as it is."""
    if isinstance(item, torch.Tensor):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model states file of model-parallel rank `mp_rank_str` ('00') in a tag's folder."""
    return os.path.join(base_folder, "mp_rank_" + mp_rank_str + "_model_states.pt")
