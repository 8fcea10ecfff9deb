"""`deepspeed.ops.adagrad`: DeepSpeed's CPU Adagrad as torch's Adagrad with its arguments."""
from __future__ import annotations

from typing import Any, Iterable

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad (lr 0.01, eps 1e-10): torch's Adagrad computes the same update."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise NotImplementedError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported (DeepSpeed ignores it)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.defaults.update(fp32_optimizer_states=fp32_optimizer_states)


__all__ = ["DeepSpeedCPUAdagrad"]
