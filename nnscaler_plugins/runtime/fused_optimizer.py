"""Which implementation of a torch optimizer `nns.build_optimizer` asks for when the caller does not say.

torch's Adam, AdamW, SGD and Adagrad each come in three implementations of the same update: a loop
of one kernel per tensor and per operation (the default on a CPU), `foreach` (one multi-tensor kernel
per operation: the default on a GPU) and `fused` (one kernel per tensor for the whole update, opt-in).
The fused one reads and writes each parameter, gradient and state once instead of once per operation:
on a CPU, AdamW over a GPT-2-sized model steps about three times faster than the default loop, and on
a GPU it is the implementation torchtitan and Megatron-Core train with.

It computes the same update in another order of floating-point operations (the results differ in the
last bits, about 1e-7 relative per step in fp32), so it is taken only where torch has the kernel for
every tensor's device and dtype, and never over the caller's own choice: `fused=` or `foreach=` given
to `build_optimizer` (or in a parameter group) is passed through unchanged, and `fused=False` is the
way to keep torch's default.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

# Optimizer class -> the device types torch has its fused kernel for (torch 2.4 and later).
_FUSED_ON: dict[type, frozenset[str]] = {
    torch.optim.Adam: frozenset({"cpu", "cuda"}),
    torch.optim.AdamW: frozenset({"cpu", "cuda"}),
    torch.optim.SGD: frozenset({"cpu", "cuda"}),
    torch.optim.Adagrad: frozenset({"cpu"}),
}
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CHOICES = ("fused", "foreach", "differentiable")


def fused_by_default(optimizer_cls: type, tensors: Iterable[torch.Tensor], kwargs: Mapping[str, Any],
                     groups: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Whether to build `optimizer_cls` over `tensors` with `fused=True`: torch's own class (not a
    subclass, whose step may not take the flag), no implementation chosen by the caller in `kwargs`
    or any group, and every tensor real floating point on a device the fused kernel runs on."""
    devices = _FUSED_ON.get(optimizer_cls)
    if devices is None:
        return False
    if any(kwargs.get(k) is not None for k in _CHOICES) or any(g.get(k) is not None for g in groups for k in _CHOICES):
        return False
    ts = list(tensors)
    return bool(ts) and all(t.device.type in devices and t.dtype in _FUSED_DTYPES for t in ts)
