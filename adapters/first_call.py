"""Planning a framework's model at its first real call, inside the user's own step.

An adapter does not know what the user's step passes the model until the step runs: the batch the
framework hands it, what `training_step` builds from it, under the framework's autocast and hooks.
So nothing is called ahead: `plan_at_first_call` makes the module's next call (the first one the
user's loop makes) hand its arguments to the adapter, which plans the model on them and returns
what runs from then on; that call is answered by it. Until then the module is exactly the user's
(its attributes, parameters, state dict and hooks), so code that reads `self.layer.weight` or
builds an optimizer from `parameters()` before the first step sees what it would without us.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

#: what `plan(module, args, kwargs)` returns: the callable that answers this call and every later one
Planner = Callable[[torch.nn.Module, tuple, dict], Callable[..., Any]]


class _PlanAtFirstCall:
    """The module's `forward` until its first call (an instance attribute, so the class's own forward
    is untouched and comes back by deleting it). Pickles and deep-copies as the module's own forward:
    a copy made before the first call is the plain module."""

    def __init__(self, module: torch.nn.Module, plan: Planner) -> None:
        self.module, self.plan = module, plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        module.__dict__.pop("forward", None)  # capture and any later call see the class's forward
        try:
            run = self.plan(module, args, kwargs)
        except BaseException:
            self.module = None  # the module keeps its own forward; nothing refers back to the adapter
            raise
        return run(*args, **kwargs)

    def __reduce__(self) -> Any:
        return getattr, (self.module, "forward")


def plan_at_first_call(module: torch.nn.Module, plan: Planner) -> None:
    """Make `module`'s next call run `plan(module, args, kwargs)` on its real arguments first and
    then the callable that returns (the planned model) on them."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"plan_at_first_call needs an nn.Module, got {type(module).__name__}")
    module.__dict__["forward"] = _PlanAtFirstCall(module, plan)


def pending(module: Any) -> bool:
    """Whether `module` waits for its first call to be planned."""
    return isinstance(getattr(module, "__dict__", {}).get("forward"), _PlanAtFirstCall)


def cancel(module: torch.nn.Module) -> None:
    """The module's own forward back, unplanned (a stage that ends before any call)."""
    if pending(module):
        module.__dict__.pop("forward")


@contextlib.contextmanager
def planning_context(device: torch.device) -> Iterator[None]:
    """Where a plan is made inside the user's step: with gradients (an evaluation stage's first
    call runs under `inference_mode`), without the step's autocast (the capture is of the model's
    own dtypes; the program runs under the autocast of each later call, as before)."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        yield


def ordinary_tensors(value: Any) -> Any:
    """`value` with tensors made under `inference_mode` copied to ordinary ones (a capture traces
    them with autograd on)."""
    def fix(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_inference():
            return t.clone()
        return t

    return pytree.tree_map(fix, value)
