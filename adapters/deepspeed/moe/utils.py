"""`deepspeed.moe.utils`: the optimizer-group helpers DeepSpeed's scripts call on every model
(DeepSpeedExamples' cifar script calls `split_params_into_different_moe_groups_for_optimizer` with or
without --moe). They follow DeepSpeed 0.19's `moe/utils.py` line for line: an expert parameter is
one marked `allreduce=False` with a `group_name`; a model with none keeps its groups as they are."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Set, Tuple, Union

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> Tuple[bool, int]:
    """(whether `m` holds a `deepspeed.moe.layer.MoE`, the number of experts of the first one)."""
    from .layer import MoE  # noqa: PLC0415 - layer imports this module's callers' names

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter: `param.allreduce` set to False."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
        params: List[nn.Parameter]) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: List[nn.Parameter]
                                                     ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    expert, shared = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float] = 178956971) -> List[Dict[str, Any]]:
    """DeepSpeed's split of optimizer groups: each group's expert parameters move to groups of their
    own (`'moe': True`, named by the expert group), at most `max_group_size` elements each."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names: Set[str] = {p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)}
    group_moe: Dict[str, Dict[str, Dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    for g in param_groups:
        for key in names:
            group_moe[g["name"]][key] = {**g, "name": key, "moe": True, "params": []}
    for g in param_groups:
        kept = []
        for p in g["params"]:
            if is_moe_param(p):
                group_moe[g["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        g["params"] = kept
    for moe_group in group_moe.values():
        for g in moe_group.values():
            if max_group_size is None:
                param_groups.append(g)
                continue
            chunks: List[List[nn.Parameter]] = []
            cur: List[nn.Parameter] = []
            size = 0
            for p in g["params"]:
                n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                if size + n <= max_group_size:
                    cur.append(p)
                    size += n
                else:
                    chunks.append(cur)
                    cur, size = [p], n
            if cur:
                chunks.append(cur)
            param_groups.extend({**g, "params": c} for c in chunks)
    return param_groups


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)
