"""Optimizer state in the frameworks' own checkpoints (Lightning's .ckpt, the Trainer's checkpoint
directories), kept so that a resume works under another plan or process count.

The model weights in both are whole tensors already. The optimizer state is stored the way
`nns.checkpoint` stores it: whole tensors under parameter names (`full_optimizer_state`), cut again
by the resuming plan (`load_optimizer_state`), for a plain torch optimizer over the parallelized
module's parameters and for `nns.build_optimizer`'s alike. Only an optimizer that also holds
tensors from outside the parallelized module (a Lightning module with other trainable children)
is stored per rank; that state fits only the plan and process count that wrote it, and a resume
under another one is refused, naming both, before anything is restored.

Checks run on every rank and are agreed on (`agree`), so every rank refuses together instead of
some waiting in a collective for the others.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

WHOLE = "nnscaler_whole"          # whole optimizer state under parameter names (reshardable)
PER_RANK = "nnscaler_per_rank"    # every rank's own optimizer state_dict (this plan and world size only)
PLAN = "nnscaler_plan"            # the saving plan, as nns.checkpoint's metadata records it

log = logging.getLogger("nnscaler_plugins.adapters")


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed under this plan; raised before anything is restored."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def plan_record(module: Any) -> dict[str, Any]:
    from nnscaler_plugins.checkpoint.save import plan_summary

    return plan_summary(module)


def describe(record: Optional[dict]) -> str:
    """'tp {...} on 2 processes (2 x dp 1)' for messages; legacy checkpoints recorded no plan."""
    if not record:
        return "an unrecorded plan (a checkpoint written before plans were recorded)"
    options = {k: v for k, v in (record.get("options") or {}).items() if k not in ("estimated_step_s",
                                                                                  "estimated_peak_bytes")}
    return (f"plan {record.get('strategy')!r}" + (f" {options}" if options else "")
            + f" on {record.get('world_size')} process(es) ({record.get('unit_size')} per replica x dp "
            f"{record.get('dp')})")


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under the frameworks' wrappers (LightningOptimizer, AcceleratedOptimizer)."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def _fqns_by_group(module: Any, optimizer: Any) -> Optional[list[list[str]]]:
    """This rank's parameter names per group of `optimizer`, or None when it holds a tensor that is
    not one of the module's parameters."""
    from nnscaler_plugins.checkpoint.optimizer_state import param_index, knows_plan

    if knows_plan(optimizer):
        fqn_of = {id(e.master): e.fqn for e in optimizer.entries}
    else:
        fqn_of = {k: name for k, (name, _) in param_index(module).items()}
    out = []
    for g in optimizer.param_groups:
        names = [fqn_of.get(id(p)) for p in g["params"]]
        if any(n is None for n in names):
            return None
        out.append(names)
    return out


def save_state(module: Any, optimizer: Any) -> dict[str, Any]:
    """What a framework checkpoint stores for one optimizer (collective: every rank calls it; the
    tensors are complete on rank 0, which writes the file)."""
    from nnscaler_plugins.checkpoint import full_optimizer_state

    world, rank = _world()
    opt = inner_optimizer(optimizer)
    record = plan_record(module)
    mine = _fqns_by_group(module, opt) is not None
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if all(everyone):
        keep = (lambda sizes: set(sizes)) if rank == 0 else (lambda sizes: set())
        return {WHOLE: full_optimizer_state(module, opt, keep=keep, rank0_only=True), PLAN: record}
    local = opt.state_dict()
    gathered: list[Any] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    return {PER_RANK: gathered, "world_size": world, PLAN: record}


def problems(module: Any, optimizer: Any, saved: dict[str, Any], index: int = 0) -> list[str]:
    """Why `saved` (from `save_state`, or a per-rank state of an older version) cannot be loaded
    into `optimizer` under this module's plan; empty when it can. No communication."""
    opt = inner_optimizer(optimizer)
    label = f"optimizer {index}"
    world, rank = _world()
    if WHOLE in saved:
        names = _fqns_by_group(module, opt)
        if names is None:
            return [f"{label} holds tensors that are not parameters of the parallelized module; it cannot take the "
                    "checkpoint's whole (per-parameter) state"]
        groups = saved[WHOLE].get("param_groups", [])
        if len(groups) != len(names):
            return [f"{label}: the checkpoint has {len(groups)} parameter group(s), this optimizer {len(names)}"]
        from nnscaler_plugins.checkpoint.optimizer_state import knows_plan

        out = []
        state = saved[WHOLE].get("state", {})
        for gi, (mine, theirs) in enumerate(zip(names, groups)):
            lacking = [n for n in mine if n not in set(theirs["params"])]
            if lacking:
                out.append(f"{label} group {gi}: {lacking[:4]} not in the checkpoint's group {gi}")
            stateless = [n for n in mine if state and n not in state]
            if stateless and knows_plan(opt):  # the plan's optimizer steps every parameter it holds
                out.append(f"{label} group {gi}: the checkpoint has no state for {stateless[:4]}")
        return out
    if PER_RANK not in saved:
        return [f"{label}: this checkpoint's optimizer state was not saved by this adapter; resume with the strategy "
                "that wrote it, or load only the weights"]
    record = saved.get(PLAN)
    if saved.get("world_size") != world:
        return [f"{label} was saved per rank by {describe(record)}; this run has {world} process(es)"]
    if record is not None:
        now = plan_record(module)
        if any(record.get(k) != now.get(k) for k in ("strategy", "world_size", "unit_size", "dp", "options",
                                                       "pipeline_stages")):
            return [f"{label} was saved per rank by {describe(record)}; this run is {describe(now)}"]
        return []
    # an older checkpoint without its plan: its pieces must at least have this rank's shapes
    local = saved[PER_RANK][rank]
    params = [p for g in opt.param_groups for p in g["params"]]
    out = []
    for i, st in local.get("state", {}).items():
        if int(i) >= len(params):
            out.append(f"{label}: the checkpoint has state for {int(i) + 1} or more tensors, this rank holds "
                       f"{len(params)}")
            break
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(params[int(i)].shape):
                out.append(f"{label}: state {k!r} of tensor {i} has shape {tuple(v.shape)} in the checkpoint, "
                           f"{tuple(params[int(i)].shape)} here")
                break
    return out[:4]


def agree(found: list[str]) -> list[str]:
    """Every rank's problems, on every rank (collective), each once."""
    world, rank = _world()
    if world == 1:
        return found
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, [f"rank {rank}: {p}" for p in found])
    out, seen = [], set()
    for per_rank in everyone:
        for p in per_rank:
            text = p.split(": ", 1)[1]
            if text not in seen:
                seen.add(text)
                out.append(p)
    return out


def refuse(where: str, found: list[str], saved_plan: Optional[dict], module: Any) -> None:
    """Raise ResumeError naming the saving and the resuming plan, if there are problems."""
    if found:
        raise ResumeError(f"{where}: cannot resume: the checkpoint was saved by {describe(saved_plan)}, this run is "
                          f"{describe(plan_record(module))}; nothing was restored.\n  " + "\n  ".join(found))


def load_state(module: Any, optimizer: Any, saved: dict[str, Any]) -> None:
    """This rank's pieces of the saved state, under this module's plan (call `problems` first)."""
    from nnscaler_plugins.checkpoint import load_optimizer_state

    opt = inner_optimizer(optimizer)
    if WHOLE in saved:
        load_optimizer_state(module, opt, saved[WHOLE])
        return
    _, rank = _world()
    opt.load_state_dict(saved[PER_RANK][rank])


def note_resharding(saved_plan: Optional[dict], module: Any, what: str) -> None:
    """One log line on rank 0 when a resume changes plan or process count."""
    now = plan_record(module)
    if saved_plan and rank_zero() and any(saved_plan.get(k) != now.get(k)
                                          for k in ("strategy", "world_size", "dp", "options")):
        log.info("%s: resuming a checkpoint of %s under %s; the optimizer state is resharded", what,
                 describe(saved_plan), describe(now))


def rank_zero() -> bool:
    return _world()[1] == 0
