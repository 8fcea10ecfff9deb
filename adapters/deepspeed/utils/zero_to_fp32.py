"""`deepspeed.utils.zero_to_fp32`: the whole fp32 weights of a checkpoint, read offline.

    state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt_dir")       # tag from `latest`
    convert_zero_checkpoint_to_fp32_state_dict("ckpt_dir", "out_dir")      # pytorch_model.bin
    model = load_state_dict_from_zero_checkpoint(model, "ckpt_dir")

The reader takes the files in DeepSpeed's layout (the ones this engine writes, see
`checkpoint/optim_states.py`, which are DeepSpeed's own): each parameter's fp32 master is put
back together from every data-parallel rank's flat partition (`*_optim_states.pt`), in the order
and shapes of the model states file's `param_shapes`; frozen parameters come from the model states
files' fragments, buffers from the module state, tied names from `shared_params`. A checkpoint
with no optimizer files (ZeRO-0 in fp32, where the weights are the masters) gives the module state
in fp32. No process group is needed.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
from collections import OrderedDict
from typing import Any, Optional, Union

import torch

LATEST = "latest"


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _files(path: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, pattern)), key=_natural)


def _tag_dir(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


def _load(file: str) -> Any:
    return torch.load(file, map_location="cpu", weights_only=False)


def _frozen(states: list[dict], exclude: bool) -> "OrderedDict[str, torch.Tensor]":
    """Frozen parameters: each model states file holds a fragment; joined, they start with the tensor."""
    out: OrderedDict = OrderedDict()
    shapes = states[0].get("frozen_param_shapes") or {}
    if exclude:
        return out
    for name, shape in shapes.items():
        parts = [s["frozen_param_fragments"][name].reshape(-1) for s in states
                 if name in (s.get("frozen_param_fragments") or {})]
        numel = math.prod(shape)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        out[name] = flat[:numel].float().reshape(shape).clone()
    return out


def _trainable(optim: list[dict], param_shapes: list) -> "OrderedDict[str, torch.Tensor]":
    """Trainable parameters' fp32 masters from every rank's flat partitions."""
    out: OrderedDict = OrderedDict()
    first = optim[0]
    stage = first.get("zero_stage", 3 if "fp32_flat_groups" in first else 1)
    world = len(optim)
    for g, shapes in enumerate(param_shapes):
        if stage >= 3:
            flats = [o["fp32_flat_groups"][g].reshape(-1) for o in optim]
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                size = math.ceil(numel / world)
                whole = torch.cat([f[offset:offset + size] for f in flats])[:numel]
                out[name] = whole.float().reshape(shape).clone()
                offset += size
        else:
            flat = torch.cat([o["single_partition_of_fp32_groups"][g].reshape(-1) for o in optim])
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                if offset + numel > flat.numel():
                    raise ValueError(f"{name}: the optimizer files hold {flat.numel()} values for param group {g}, "
                                     f"fewer than its parameters need (a file of some rank is missing?)")
                out[name] = flat[offset:offset + numel].float().reshape(shape).clone()
                offset += numel
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The whole fp32 state dict of the checkpoint in `checkpoint_dir` (the tag `latest` names, or
    `tag`): trainable parameters from their fp32 masters, frozen ones, buffers and tied names.
    `lazy_mode` is accepted; the tensors are real (call `.contiguous()` on them all the same)."""
    path = _tag_dir(str(checkpoint_dir), tag)
    model_files = _files(path, "*_model_states.pt")
    if not model_files:
        raise FileNotFoundError(f"can't find any model state file in '{path}'")
    states = [_load(f) for f in model_files]
    first = states[0]
    module = first.get("module") or {}
    out: OrderedDict = OrderedDict()
    for name in first.get("buffer_names", []):
        if name in module:
            out[name] = module[name]
    optim_files = _files(path, "*_optim_states.pt")
    if optim_files:
        optim = [_load(f)["optimizer_state_dict"] for f in optim_files]
        out.update(_frozen(states, exclude_frozen_parameters))
        out.update(_trainable(optim, first["param_shapes"]))
    else:  # fp32 without ZeRO: the module state is the masters
        frozen = set((first.get("frozen_param_shapes") or {}).keys())
        for name, value in module.items():
            if exclude_frozen_parameters and name in frozen:
                continue
            out[name] = value.float() if value.is_floating_point() else value
    for alias, name in (first.get("shared_params") or {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Union[str, os.PathLike],
                                               output_dir: Union[str, os.PathLike],
                                               max_shard_size: Optional[Union[str, int]] = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the checkpoint's whole fp32 state dict to `output_dir` as `pytorch_model.bin`
    (`model.safetensors` with safe_serialization), in shards of at most `max_shard_size` with
    Hugging Face's index file when it is larger (huggingface_hub cuts them, as in DeepSpeed)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    files = {weights_name: list(state)}
    index = None
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards

        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    os.makedirs(output_dir, exist_ok=True)
    shared = _aliases(state)
    for file, names in files.items():
        shard = {n: state[n].contiguous() for n in names}
        target = os.path.join(output_dir, file)
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({n: (t.clone() if n in shared else t) for n, t in shard.items()}, target,
                      metadata={"format": "pt"})
        else:
            torch.save(shard, target)
    if index is not None:
        name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _aliases(state: dict) -> set:
    """Names whose tensor another name holds too (safetensors stores no shared storage)."""
    seen: dict = {}
    out = set()
    for n, t in state.items():
        key = (t.data_ptr(), t.numel()) if isinstance(t, torch.Tensor) else None
        if key in seen:
            out.add(n)
        seen.setdefault(key, n)
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: Union[str, os.PathLike],
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Move `model` to the CPU and load the checkpoint's whole fp32 weights into it (not strict, as
    DeepSpeed's); returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
