"""A framework's optimizer rebuilt as the plan's ZeRO-sharded one.

Frameworks build their optimizer from the module's parameters before training starts (Lightning's
`configure_optimizers`); under a ZeRO plan the state must live in `nns.build_optimizer`'s shards.
The rebuilt optimizer has the same class, defaults and parameter groups (their hyperparameters,
learning rates included), with the groups' parameters named by their model FQNs.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch


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
