"""`deepspeed.utils.module_utils`: reaching a submodule by its dotted name, as DeepSpeed-Chat's LoRA
helper does (DeepSpeed 0.19's functions, same names and arguments)."""
from __future__ import annotations

from typing import Any

import torch


def recursive_getattr(model: torch.nn.Module, module_name: str) -> Any:
    """The attribute at the dotted path `module_name` of `model` ("decoder.layers.0.fc1")."""
    output: Any = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: torch.nn.Module, module_name: str, module: Any) -> None:
    """Set the attribute at the dotted path `module_name` of `model` to `module`."""
    parts = module_name.split(".")
    output: Any = model
    for name in parts[:-1]:
        output = getattr(output, name)
    output.__setattr__(parts[-1], module)
