"""The config's `optimizer` section as a torch optimizer, with DeepSpeed's reading of its names.

DeepSpeed matches its own optimizer names case-insensitively and hands any other name to
`getattr(torch.optim, name)`. Its "Adam" runs in AdamW mode (decoupled weight decay) unless
`adam_w_mode` is false; it builds its FusedAdam (weight_decay 0 by default), DeepSpeedCPUAdam when
the optimizer is offloaded to the host, and torch's Adam/AdamW (torch's defaults: AdamW's
weight_decay is 0.01) with `torch_adam: true`. The same classes are built here, under the same
names (`deepspeed.ops.adam`): torch's Adam with DeepSpeed's arguments, the same update.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from .errors import DeepSpeedConfigError
from .param_types import check_param_types

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam", "amsgrad",
              "fp32_optimizer_states", "foreach"}
_UNSUPPORTED = {"lamb": "FusedLamb is a CUDA kernel", "lion": "DeepSpeed's Lion kernels",
                "muadam": "mup's optimizers", "muadamw": "mup's optimizers", "musgd": "mup's optimizers",
                "muon": "DeepSpeed's Muon", "onebitadam": "removed from DeepSpeed 0.19",
                "zerooneadam": "removed from DeepSpeed 0.19", "onebitlamb": "removed from DeepSpeed 0.19"}


def check_optimizer_section(name: Any, params: dict) -> None:
    """Refuse what `build_optimizer` could not build, before any process starts."""
    if not isinstance(name, str):
        raise DeepSpeedConfigError(f"optimizer.type must be a name, got {name!r}")
    if "max_grad_norm" in params:
        raise DeepSpeedConfigError("optimizer.params.max_grad_norm is not supported (DeepSpeed refuses it too); use "
                                   "the top-level 'gradient_clipping'")
    low = name.lower()
    torch_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad}.get(
        low, getattr(torch.optim, name, None))
    if isinstance(torch_class, type):
        check_param_types(torch_class, params, "optimizer.params")
    if low in _UNSUPPORTED:
        raise DeepSpeedConfigError(f"optimizer.type {name!r} is not supported ({_UNSUPPORTED[low]}); use Adam, AdamW, "
                                   "Adagrad or any torch.optim class name such as SGD")
    if low in ("adam", "adamw"):
        unknown = sorted(set(params) - _ADAM_KEYS)
        if unknown:
            raise DeepSpeedConfigError(f"optimizer.params {unknown} are not parameters of DeepSpeed's {name}")
        if params.get("bias_correction", True) is not True:
            raise DeepSpeedConfigError("optimizer.params.bias_correction=false is not supported; remove it")
        if params.get("amsgrad"):
            raise DeepSpeedConfigError("optimizer.params.amsgrad=true: DeepSpeed's Adam does not support it either")
        return
    if low == "adagrad":
        return
    if not hasattr(torch.optim, name):
        raise DeepSpeedConfigError(f"optimizer.type {name!r} is neither a DeepSpeed optimizer nor a torch.optim class "
                                   "(names outside DeepSpeed's own are case-sensitive, e.g. 'SGD')")


def build_optimizer(name: str, params: dict, model_parameters: Iterable[Any],
                    cpu_optimizer: bool = False) -> torch.optim.Optimizer:
    """A torch optimizer over `model_parameters` (parameters or param-group dicts); `cpu_optimizer`:
    the optimizer is offloaded to the host (DeepSpeed then builds its CPU Adam)."""
    from .ops.adam import DeepSpeedCPUAdam, FusedAdam

    check_optimizer_section(name, params)
    kw = dict(params)
    low = name.lower()
    if low in ("adam", "adamw"):
        adam_w_mode = kw.pop("adam_w_mode", True)
        torch_adam = kw.pop("torch_adam", False)
        for k in ("bias_correction", "amsgrad", "fp32_optimizer_states"):
            kw.pop(k, None)
        foreach = kw.pop("foreach", None)
        decoupled = low == "adamw" or adam_w_mode
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        if torch_adam:  # torch's class, torch's defaults
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            return cls(model_parameters, foreach=foreach, **kw)
        if cpu_optimizer:
            return DeepSpeedCPUAdam(model_parameters, adamw_mode=decoupled, **kw)
        return FusedAdam(model_parameters, adam_w_mode=decoupled, **kw)
    if low == "adagrad":
        return torch.optim.Adagrad(model_parameters, **kw)
    cls = getattr(torch.optim, name)
    try:
        return cls(model_parameters, **kw)
    except TypeError as e:
        raise DeepSpeedConfigError(f"optimizer {name}: {e}") from None
