"""ZeRO set-up for one device: the chunk of each trainable parameter this data-parallel replica
owns (`zero_shards`), and at stage 3 the parameters replaced by those chunks (`chunk_parameters`).

Sharding is across the replicas of each unit device; without ZeRO, or with one replica, every
`FlatShard` is the whole parameter (size 1). `runtime/zero.py` holds what runs with them.
`float8_gathered` names the parameters a precision="fp8" plan's ZeRO-3 gathers in float8.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from nnscaler_plugins.plan.float8 import all_gather_in_float8, float8_weights
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


def float8_gathered(program: Program, unit_device: int) -> list[str]:
    """The fqns of the parameters this device's ZeRO-3 all-gathers in float8 (the `fp8_all_gather`
    knob): weights that its code reads only as the weight of a float8 linear, called whole (a
    co-sharded or fused call cuts or sends its weight in high precision, so its weight is gathered so)."""
    plan = program.plan
    if not all_gather_in_float8(plan.precision, plan.zero, plan.dp, plan.knobs):
        return []
    local = {sh.value: tuple(sh.layout.local_shape()) for sh in program.shards.values()
             if sh.kind == "param" and unit_device in sh.layout.group}
    weights = set(float8_weights(program.graph, plan.knobs, local))
    held = set(program.ranks[unit_device].params)
    wanted = {key for key, sh in program.shards.items() if key in held and sh.kind == "param" and sh.value in weights}
    for sp in program.ranks[unit_device].stages.values():
        for st in sp.stmts:
            whole_call = (st.kind == "op" and st.coshard is None and st.fused_reshards is None
                          and st.target is torch.ops.aten.linear.default and len(st.args) > 1)
            for leaf in pytree.tree_leaves((st.args, st.kwargs)):
                name = getattr(leaf, "name", None)
                if name in wanted and not (whole_call and st.args[1] is leaf):
                    wanted.discard(name)
            if st.src in wanted:
                wanted.discard(st.src)
        wanted -= set(sp.sent) | {o for o in sp.outputs if o}
    return sorted(program.shards[k].fqn for k in wanted)
