"""A framework's optimizer pointed at the planned model's parameters, or rebuilt as the plan's
ZeRO-sharded one.

Frameworks build their optimizer from the module's parameters before training starts (Lightning's
`configure_optimizers`), and the model is planned later, at its first call in the user's step
(`first_call`). `point_at_planned` then puts this rank's pieces in place of the plain parameters in
the optimizer's own groups, in place, so every reference the framework or the user holds to the
optimizer stays right. Under a ZeRO plan the state must live in `nns.build_optimizer`'s shards:
`rebuild_sharded` makes that optimizer, with the same class, defaults and parameter groups (their
hyperparameters, learning rates included), the groups' parameters named by their model FQNs.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch


def point_at_planned(optimizer: torch.optim.Optimizer, names: dict[int, list[str]],
                     planned: Callable[[str], Optional[torch.Tensor]], framework: str) -> None:
    """Replace, in each param group, every parameter by the planned ones of its names.

    `names`: the plain parameters' ids -> all their FQNs (a tied weight has several, and a plan may
    keep a piece of it under each), taken before planning; `planned(fqn)`: this rank's parameter
    for it (None where this rank holds none of it: a pipeline stage's other layers, which leave the
    group). State already kept for a parameter moves with it when the shapes agree; a parameter the
    optimizer holds that is not the model's is refused by name."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    for i, group in enumerate(inner.param_groups):
        kept: list[torch.Tensor] = []
        for p in group["params"]:
            fqns = names.get(id(p))
            if not fqns:
                raise ValueError(f"{framework}: param group {i} of {type(inner).__name__} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is no parameter of the model; optimize the model's "
                                 "parameters (self.parameters() or named submodules' ones)")
            state = inner.state.pop(p, None)
            news = []
            for fqn in fqns:
                new = planned(fqn)
                if new is not None and all(new is not q for q in news + kept):
                    news.append(new)
            if state:
                if len(news) != 1 or tuple(news[0].shape) != tuple(p.shape):
                    raise ValueError(f"{framework}: the optimizer holds state for {fqns[0]} before the first step, "
                                     "and the plan splits or copies it here; build the optimizer's state in the "
                                     "first step, as torch's optimizers do")
                inner.state[news[0]] = state
            kept += news
        group["params"] = kept


def rebuild_sharded(module: Any, optimizer: torch.optim.Optimizer, framework: str) -> Any:
    import nnscaler_plugins as nns

    inner = getattr(optimizer, "_optimizer", optimizer)  # a framework's wrapper around the torch optimizer
    fqn_of = {}
    for fqn in module.zero_shards:
        fqn_of[id(module.parameter(fqn))] = fqn
    groups = []
    for i, g in enumerate(inner.param_groups):
        names = []
        for p in g["params"]:
            if id(p) not in fqn_of:
                raise ValueError(f"{framework}: a ZeRO plan shards the optimizer of the parallelized module, but "
                                 f"param group {i} of {type(inner).__name__} holds a tensor of shape "
                                 f"{tuple(p.shape)} from outside it; optimize only that module's parameters, or "
                                 "use the plan without zero=")
            names.append(fqn_of[id(p)])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    if inner.state:
        raise ValueError(f"{framework}: the optimizer already has state; a ZeRO plan rebuilds it before training")
    cls = type(inner)
    takes = inspect.signature(cls.__init__).parameters
    # defaults the class sets itself (AdamW's decoupled_weight_decay) are not constructor arguments
    defaults = {k: v for k, v in inner.defaults.items() if k in takes}
    return nns.build_optimizer(module, cls, param_groups=groups, **defaults)
