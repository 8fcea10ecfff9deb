"""When a captured plan may run the model's own forward for a batch its captured program cannot take.

A plan that keeps whole layers on each device (dp, ZeRO 1-3, offload) stores every parameter and buffer
whole per replica (or as ZeRO-3 chunks of the whole) in the same layout under either executor (see
`lower/eager.py`). So where capture worked but a later batch has sizes its program cannot serve -- a
length whose split would communicate otherwise, code that branches on a length, one program per shape
needed -- the eager executor can take that batch on the same shards, as DDP or FSDP2 would run it,
instead of refusing it. This module says whether that is possible for a given plan and model, and if
not, why (`ParallelModule.no_fallback` keeps the reason for the refusal's message).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from nnscaler_plugins.lower.eager import runs_eagerly
from nnscaler_plugins.plan.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


def fallback_problem(plan: Plan, model: Any, program: "Program") -> Optional[str]:
    """Why the captured `program` of `plan` cannot hand a batch to the eager executor on `model`'s
    code, or None when it can: the plan must keep whole layers per device, leave the executor to the
    library (`executor="auto"`), not run float8 linears (the captured program's own kernels), and hold
    every parameter and buffer of `model` under its name."""
    if plan.knobs.executor != "auto":
        return f"executor={plan.knobs.executor!r} was asked for"
    if not runs_eagerly(plan):
        return (f"the plan ({plan.mesh.describe()}{', a pipeline' if plan.pipeline is not None else ''}) splits "
                "layers across devices, so only its captured program runs them")
    if plan.precision == "fp8":
        return "float8 linears run only in the captured program"
    if not isinstance(model, torch.nn.Module):
        return "the model was given as a captured graph, not as a module whose forward can run"
    names = set()
    for s in program.shards.values():
        names.add(s.fqn)
        names.update(s.aliases)
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in names]
    missing += [n for n, b in model.named_buffers(remove_duplicate=False)
                if n not in names and b is not None and b.is_meta]
    if missing:
        return (f"the captured program holds no {missing[0]!r} of the model"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which its own forward reads")
    return None
