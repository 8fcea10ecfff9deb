"""`deepspeed.ops.adam`: DeepSpeed's Adam classes as torch's Adam with their arguments.

DeepSpeed's FusedAdam (GPU kernel) and DeepSpeedCPUAdam (host kernel) compute Adam, in AdamW mode
(decoupled weight decay) by default; torch's Adam computes the same update with
`decoupled_weight_decay`. Their other arguments are DeepSpeed's: what torch's Adam cannot do
(no bias correction, AMSGrad in FusedAdam, which DeepSpeed refuses too) is refused by name.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


def _refuse(cls: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise NotImplementedError(f"{cls}(bias_correction=False) is not supported here; leave bias_correction=True")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam: Adam, AdamW when adam_w_mode (the default); weight_decay defaults to 0."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0,
                 amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        _refuse("FusedAdam", bias_correction)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
        self.defaults.update(adam_w_mode=adam_w_mode, bias_correction=True, set_grad_none=set_grad_none)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: Adam, AdamW when adamw_mode (the default); state kept in fp32."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        _refuse("DeepSpeedCPUAdam", bias_correction)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode
        self.defaults.update(adamw_mode=adamw_mode, bias_correction=True, fp32_optimizer_states=fp32_optimizer_states)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
