"""Compute precision: which dtype the model runs in, and dynamic loss scaling for fp16.

With "bf16" or "fp16" the module's parameters (and so its gradients) are stored in that dtype and
the forward runs under autocast in it, so ops torch keeps in fp32 (softmax, losses, norms) stay
accurate; the optimizer steps fp32 master copies and writes the result back rounded. Gradients
are reduced across replicas in the compute dtype (as DeepSpeed does by default), and converted to
fp32 only for the optimizer step.

fp16's narrow range needs the loss multiplied before backward so small gradients do not flush to
zero; `LossScaler` is the dynamic scaler DeepSpeed and apex use: start at 2**16, halve on an
overflow (the step is skipped), double after `window` clean steps, never below `min_scale`.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

# "fp8" computes in bf16 like "bf16"; its converted linears multiply in float8 (kernels/float8.py).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(DTYPES)}") from None


def autocast(precision: str, device: torch.device) -> ContextManager:
    """The forward's autocast context (nothing for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(precision))


def for_compute(t: torch.Tensor, precision: str) -> torch.Tensor:
    """A parameter or buffer as the generated code takes it: in bf16/fp16, 1-D parameters (norm
    weights, biases) in fp32, which is what CPU norm kernels take next to a half-precision input
    (matmuls under autocast cast them back)."""
    if precision != "fp32" and t.dim() == 1 and t.is_floating_point() and t.dtype != torch.float32:
        return t.float()
    return t


class LossScaler:
    """Dynamic loss scale for fp16 (DeepSpeed's defaults)."""

    def __init__(self, initial: float = 2.0 ** 16, window: int = 1000, factor: float = 2.0, min_scale: float = 1.0):
        self.scale = float(initial)
        self.window = int(window)
        self.factor = float(factor)
        self.min_scale = float(min_scale)
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / self.factor)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= self.factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "window": self.window, "factor": self.factor,
                "min_scale": self.min_scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state.get("clean_steps", 0))
