"""Rules read off a custom autograd Function's own code, for Functions no plugin gave a rule.

A Function is kept whole through capture (its forward and backward are the user's,
capture/autograd_functions.py), so its dimension rule cannot come from the ops inside it. One
case can be proved from the code: a Function of one tensor whose forward and backward only apply
elementwise ops (each op's rule labels every dim of its output spatial, and every tensor it reads
has the input's shape, or is a scalar) computes each output element from the same input element,
in both directions: it is elementwise, and any chunk of its input gives the same chunk of its
output and of its gradient. BLOOM's GeLU Function is one. Anything else (reductions, views,
broadcasts, several tensor inputs, an op that fails to trace) gets no rule and runs whole.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.autograd_functions import FunctionTarget
from nnscaler_plugins.rules.broadcast import out_labels
from nnscaler_plugins.rules.elementwise import UNARY_OR_BROADCAST
from nnscaler_plugins.rules.signature import OpCall, Signature

_ELEMENTWISE = frozenset(UNARY_OR_BROADCAST) - {"aten.dropout.default", "aten.empty_like.default"}


# `Function.apply` as torch defines it. Capture routes `apply` of user Functions to one opaque op
# while it traces; reading a Function's code must run its real forward and backward, even when a
# rule is asked for from inside a capture (the warning about ops without rules is).
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"]


def function_rule(call: OpCall) -> Optional[Signature]:
    """The elementwise signature for a call of a provably elementwise Function, else None."""
    target = call.target
    if not isinstance(target, FunctionTarget) or len(call.inputs) != 1 or len(call.outputs) != 1:
        return None
    x, out = call.inputs[0], call.outputs[0]
    if out is None or tuple(out.shape) != tuple(x.shape) or not x.dtype.is_floating_point:
        return None
    if not _is_elementwise(target.cls, tuple(x.shape), x.dtype):
        return None
    labels = out_labels(out.ndim)
    return Signature(inputs=(labels,), outputs=(labels,), note="elementwise Function (read from its code)")


@functools.lru_cache(maxsize=64)
def _is_elementwise(cls: type, shape: tuple, dtype: torch.dtype) -> bool:
    """Traced on fake tensors of the call's own shape (code that branches on shapes is read as it
    runs for this call; no memory is taken)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward_and_backward(x: torch.Tensor, g: torch.Tensor) -> Any:
        x = x.detach().requires_grad_(True)
        y = cls.apply(x)
        (gx,) = torch.autograd.grad(y, x, g)
        return y, gx

    patched = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = _TORCH_APPLY
    try:
        gm = make_fx(forward_and_backward, tracing_mode="fake")(torch.empty(shape, dtype=dtype),
                                                               torch.empty(shape, dtype=dtype))
    except Exception:  # noqa: BLE001 - a Function that does not trace on a probe is not proved elementwise
        return False
    finally:
        torch.autograd.Function.apply = patched
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name in ("aten.detach.default", "aten.alias.default"):
            continue
        if name not in _ELEMENTWISE:
            return False
        for arg in node.args:
            val = getattr(arg, "meta", {}).get("val") if hasattr(arg, "meta") else None
            if isinstance(val, torch.Tensor) and val.dim() > 0 and tuple(val.shape) != shape:
                return False
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != shape:
            return False
    return True
