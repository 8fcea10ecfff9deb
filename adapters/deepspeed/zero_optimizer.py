"""The optimizer `initialize` hands back under ZeRO or bf16/fp16, like DeepSpeed's wrappers.

DeepSpeed returns a wrapper (its ZeRO or mixed-precision optimizer) in these modes, not the torch
optimizer; so does this engine. Until the model is parallelized (first forward) the wrapper holds
the optimizer made over the model's parameters, so a scheduler can be built on it at once; then
it switches to `nns.build_optimizer(module, same class, param_groups=...)`, which shards the state
per the plan's ZeRO stage and keeps fp32 masters: each param group keeps its parameters (by their
names in the model) and its own hyperparameters, with every value a scheduler may already have
set in it (lr, initial_lr, betas).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

import nnscaler_plugins as nns

from .loss_scaler import DeepSpeedLossScaler


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer in every way schedulers and scripts use one; the stepping is delegated."""

    def __init__(self, optimizer: torch.optim.Optimizer):  # noqa: D107 - torch's __init__ is not called on purpose
        self.__dict__["_inner"] = optimizer
        self.__dict__["_parallel"] = False
        self.__dict__["group_names"] = None  # per param group, the model names of its parameters (once adopted)

    # What LR schedulers and scripts read and write.
    @property
    def param_groups(self) -> list:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:
        return self._inner.state

    @property
    def defaults(self) -> dict:
        return self._inner.defaults

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps: the model-parameter one before parallelization, then the
        plan's ParallelOptimizer."""
        return self._inner

    @property
    def loss_scale(self) -> float:
        return getattr(self._inner, "loss_scale", 1.0) if self._parallel else 1.0

    @property
    def last_step_skipped(self) -> bool:
        return bool(getattr(self._inner, "last_step_skipped", False))

    def adopt(self, module: Any, names: dict[int, str], loss_scale: Optional[dict] = None) -> None:
        """Switch to the plan's optimizer for the parallelized `module` (before any step). `names`
        maps each model parameter (by id) to its name in the model: every param group keeps its
        parameters, by name, and its own hyperparameters."""
        old = self._inner
        if any(len(s) for s in old.state.values()):
            raise RuntimeError("the optimizer stepped before the model was parallelized; it must not (the first "
                               "forward parallelizes the model)")
        cls = type(old)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in old.defaults.items() if k in accepted}
        trainable = {fqn for fqn in module.zero_shards}
        group_names, spec = [], []
        for i, group in enumerate(old.param_groups):
            mine = []
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise ValueError(f"param group {i} holds a tensor that is not a parameter of the model; build the "
                                     "optimizer over model.parameters() (or param groups of them)")
                if name in trainable and name not in mine:
                    mine.append(name)
            group_names.append(mine)
            spec.append({**{k: v for k, v in group.items() if k != "params" and k in accepted}, "params": mine})
        placed = {n for g in group_names for n in g}
        left = sorted(trainable - placed)
        if left:
            raise ValueError(f"trainable parameters in no param group of the optimizer: {left[:8]}; DeepSpeed would "
                             "leave them unchanged, this engine steps every trainable parameter: pass them in a "
                             "group, or set requires_grad=False")
        new = nns.build_optimizer(module, cls, param_groups=spec, **kwargs)
        for old_group, new_group in zip(old.param_groups, new.param_groups):
            for key, value in old_group.items():  # what a scheduler set (initial_lr, lr as a tensor, ...)
                if key != "params":
                    new_group[key] = value
        if loss_scale and getattr(new, "scaler", None) is not None:  # fp16: DeepSpeed's scaling rules
            new.scaler = DeepSpeedLossScaler(**loss_scale)
            module.loss_scale = new.scaler.scale
        self.__dict__["_inner"] = new
        self.__dict__["_parallel"] = True
        self.__dict__["group_names"] = group_names

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self._inner.clip_grad_norm_(max_norm)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._inner.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # LR schedulers patch `step` and add bookkeeping attributes on the instance: keep them here.
        if name in ("param_groups",):
            object.__setattr__(self, name, value)
        else:
            self.__dict__[name] = value

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self._inner!r})"
