"""ZeRO set-up for one device: the chunk of each trainable parameter this data-parallel replica
owns (`zero_shards`), and at stage 3 the parameters replaced by those chunks (`chunk_parameters`).

Sharding is across the replicas of each unit device; without ZeRO, or with one replica, every
`FlatShard` is the whole parameter (size 1). `runtime/zero.py` holds what runs with them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from nnscaler_plugins.runtime.grad_clip import counts_in_norm
from nnscaler_plugins.runtime.plan_groups import replicas_of
from nnscaler_plugins.runtime.zero import FlatShard, Zero3Params

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


def zero_shards(program: Program, trainable: list[str], parameter: Callable[[str], torch.Tensor],
                unit_device: int, dp_rank: int, groups: Any) -> dict[str, FlatShard]:
    """Per trainable parameter (by fqn; `trainable` are this device's shard keys), the chunk of it
    this replica owns under the plan's ZeRO stage."""
    plan = program.plan
    out = {}
    replicas = tuple(dp * plan.unit_size + unit_device for dp in range(plan.dp))
    sharded = plan.zero >= 1 and plan.dp > 1
    for v in trainable:
        s = program.shards[v]
        p = parameter(s.fqn)
        summed = replicas_of(plan, s.reduce_group(unit_device))
        out[s.fqn] = FlatShard(s.fqn, tuple(p.shape), groups.get(replicas) if sharded else None,
                               plan.dp if sharded else 1, dp_rank if sharded else 0,
                               sum_group=groups.get(summed) if summed != replicas and len(summed) > 1 else None,
                               count_in_norm=counts_in_norm(program, v, unit_device))
    return out


def chunk_parameters(shards: dict[str, FlatShard], parameter: Callable[[str], torch.Tensor],
                     dp: int, host: bool = False, device: Optional[torch.device] = None
                     ) -> tuple[Zero3Params, dict[str, torch.nn.Parameter]]:
    """ZeRO-3: a new Parameter per trainable parameter, the chunk of it this replica owns; returns
    the `Zero3Params` over them and the chunks by fqn, in `shards` order (Zero3Params' keys).

    With `host` (the plan's offload="params") the chunks live in host memory (pinned when a GPU
    computes) and `device` is where they are gathered whole for use."""
    chunks = {}
    for fqn, fs in shards.items():
        whole = parameter(fqn)
        chunk = fs.owned(whole.detach().reshape(-1)).clone()
        if host and chunk.device.type not in ("cpu", "meta"):
            chunk = host_copy(chunk)
        chunks[fqn] = torch.nn.Parameter(chunk, requires_grad=True)
    return Zero3Params(list(shards.values()), list(chunks.values()), dp, device=device if host else None), chunks


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory, pinned when it comes from a GPU (so copies back overlap)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    out.copy_(t)
    return out
