"""DeepSpeed's universal checkpoint (what `ds_to_universal` writes), read back into this engine.

    load_dir/latest_universal                     the tag: the universal folder's name
    load_dir/<tag>/*model_states.pt               the source's model states files, as they were
    load_dir/<tag>/zero/<param>/fp32.pt           the whole fp32 master ({"param": t, ...} or t)
    load_dir/<tag>/zero/<param>/<state>.pt        the whole optimizer state (exp_avg, exp_avg_sq)
    load_dir/<tag>/zero/<param>/step.pt           the step count (ZeRO-1/2 sources)
    load_dir/<tag>/zero/optimizer_state.pt        the optimizer's param groups (hyperparameters)

Every tensor is whole, so the state loads under any ZeRO stage, plan and world size: into the
plan's optimizer through its whole-state load, as this engine's own checkpoints do.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
COMMON_STATE = "optimizer_state.pt"


def resolve_tag(load_dir: str, tag: Optional[str]) -> str:
    """The given tag, or the one `latest_universal` names (DeepSpeed's error when it is absent)."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST_UNIVERSAL)
    if not os.path.isfile(latest):
        raise ValueError(f"Invalid for universal checkpoint: {latest} does not exist")
    with open(latest) as f:
        return f.read().strip()


def _tensor(path: str) -> Any:
    value = torch.load(path, map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def read(path: str, shapes: dict[str, torch.Size]
         ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The whole fp32 weights by name, the whole optimizer state by name (as the plan's optimizer's
    `load_full_state_dict` takes it under "state", the fp32 weights as its "master_param") and the
    optimizer's param groups' hyperparameters (empty when the folder has none).

    `shapes` gives each parameter's shape (a ZeRO-3 source stores flat tensors); a parameter the
    folder lacks, or one whose size differs, is refused by name."""
    zero = os.path.join(path, ZERO_DIR)
    if not os.path.isdir(zero):
        raise FileNotFoundError(f"{path!r} holds no {ZERO_DIR}/ folder: not a universal checkpoint (convert one "
                                "with `python -m deepspeed.checkpoint.ds_to_universal`, or set "
                                "checkpoint.load_universal to false)")
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for name, shape in shapes.items():
        folder = os.path.join(zero, name)
        if not os.path.isfile(os.path.join(folder, "fp32.pt")):
            raise KeyError(f"the universal checkpoint {path!r} has no fp32 weights for parameter {name!r}")
        entry: dict[str, Any] = {}
        for file in sorted(os.listdir(folder)):
            key, ext = os.path.splitext(file)
            if ext != ".pt":
                continue
            value = _tensor(os.path.join(folder, file))
            if key == "step":
                entry["step"] = value.clone().float() if torch.is_tensor(value) else torch.tensor(float(value))
                continue
            if value.numel() != math.prod(shape):
                raise ValueError(f"the universal checkpoint's {key} of {name!r} has {value.numel()} elements, the "
                                 f"model's parameter {math.prod(shape)} (shape {tuple(shape)})")
            entry["master_param" if key == "fp32" else key] = value.float().reshape(shape).clone()
        weights[name] = entry["master_param"]
        state[name] = entry
    common = os.path.join(zero, COMMON_STATE)
    saved = torch.load(common, map_location="cpu", weights_only=False) if os.path.isfile(common) else {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved.get("param_groups", [])]
    # A ZeRO-3 source writes no step.pt: the step is its inner optimizer's, in the common state, as
    # DeepSpeed's own ZeRO-3 universal load takes it.
    inner = (saved.get("optimizer_state_dict") or {}).get("state") or {}
    step = next((s["step"] for s in inner.values() if isinstance(s, dict) and "step" in s), None)
    for name, entry in state.items():
        if "step" in entry or len(entry) == 1:  # the weights alone: no optimizer state to resume
            continue
        if step is None:
            raise KeyError(f"the universal checkpoint {path!r} has optimizer state for {name!r} but no step count "
                           f"(neither {name}/step.pt nor one in {ZERO_DIR}/{COMMON_STATE})")
        entry["step"] = step.clone().float() if torch.is_tensor(step) else torch.tensor(float(step))
    return weights, state, groups
