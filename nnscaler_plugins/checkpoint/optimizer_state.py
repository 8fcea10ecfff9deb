"""Optimizer state as whole tensors under parameter names, and back into any plan's shards.

An optimizer that knows the plan (one with `full_state_dict` / `load_full_state_dict`, such as
the one `nns.build_optimizer` makes) is asked directly. A plain torch optimizer built over a
ParallelModule's `parameters()` keeps, for every local parameter shard, state of the shard's own
shape (Adam's moments) or scalars (the step): the shard-shaped entries are made whole with the
same layouts the module uses for its parameters, and cut again by the loading plan's layouts, so
the state follows the parameters across any change of plan or world size.

Whole form: {"state": {param_fqn: {state_key: tensor or value}},
             "param_groups": [{hyperparameters..., "params": [param_fqn, ...]}, ...]}
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.model_state import is_parallel
from nnscaler_plugins.checkpoint.pieces import knows_plan_pieces, optimizer_slots
from nnscaler_plugins.checkpoint.regions import Box, read_piece
from nnscaler_plugins.layout import Layout


def knows_plan(optimizer: Any) -> bool:
    return hasattr(optimizer, "full_state_dict") and hasattr(optimizer, "load_full_state_dict")


def param_index(module: torch.nn.Module) -> dict[int, tuple[str, Optional[Layout]]]:
    """id(local parameter) -> (model name, its layout in the plan, None for a plain module)."""
    program = getattr(module, "program", None)
    if not (is_parallel(module) and program is not None):
        return {id(p): (n, None) for n, p in module.named_parameters()}
    out: dict[int, tuple[str, Optional[Layout]]] = {}
    for v in module.held_keys:
        s = program.shards[v]
        if s.kind == "param":
            out.setdefault(id(module.local_tensor(v)), (s.fqn, s.layout))
    return out


def _local(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    index = param_index(module)
    sd = optimizer.state_dict()
    by_index: dict[int, tuple[str, Optional[Layout]]] = {}
    groups = []
    for g, sg in zip(optimizer.param_groups, sd["param_groups"]):
        names = []
        for p, i in zip(g["params"], sg["params"]):
            if id(p) not in index:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of this module; build "
                                      "it over module.parameters() of the module being saved")
            by_index[i] = index[id(p)]
            names.append(index[id(p)][0])
        groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": names})
    state = {by_index[i][0]: (by_index[i][1], dict(st)) for i, st in sd["state"].items()}
    return state, groups


def _shard_shaped(t: Any, lay: Optional[Layout]) -> bool:
    return isinstance(t, torch.Tensor) and lay is not None and t.dim() > 0 and tuple(t.shape) == lay.local_shape()


# Given the bytes of every optimizer state tensor by (parameter name, state key), the ones this
# rank keeps whole; the others come back as meta tensors (shape and dtype, no memory).
Keep = Callable[[dict[tuple[str, str], int]], set[tuple[str, str]]]


def full_optimizer_state(module: torch.nn.Module, optimizer: Any, keep: Optional[Keep] = None,
                         rank0_only: bool = False) -> dict[str, Any]:
    """Whole optimizer state (collective for a ParallelModule over several ranks): on every rank,
    or with `keep` (for a plain torch optimizer over several ranks) only the entries it selects,
    the rest as meta placeholders; with `rank0_only`, a plan-aware optimizer's whole tensors are
    kept by global rank 0 only."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if knows_plan(optimizer):
        full = optimizer.full_state_dict(rank0_only=rank0_only)
        if world > 1:  # pipeline stages list only their own parameters in their groups
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, [{"params": list(g["params"])} for g in full["param_groups"]])
            names = merge_groups(everyone)
            full["param_groups"] = [{**g, "params": n["params"]} for g, n in zip(full["param_groups"], names)]
        return full
    state, groups = _local(module, optimizer)
    if world == 1 or not is_parallel(module):
        return {"state": {f: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in st.items()} for f, (_, st) in state.items()},
                "param_groups": groups}
    return _gather(module, state, groups, world, keep)


def group_names(module: torch.nn.Module, optimizer: Any) -> list[dict]:
    """The optimizer's parameter groups with parameters by model name (this rank's parameters;
    pipeline stages' lists are joined by `merge_groups`). No communication."""
    if hasattr(optimizer, "group_names"):
        return optimizer.group_names()
    index = param_index(module)
    groups = []
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            if id(p) not in index:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of this module; build "
                                      "it over module.parameters() of the module being saved")
            names.append(index[id(p)][0])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return groups


def _describe(state: dict) -> dict:
    out = {}
    for fqn, (lay, st) in state.items():
        out[fqn] = {k: (("shard" if _shard_shaped(v, lay) else "whole"), tuple(v.shape), str(v.dtype))
                    if isinstance(v, torch.Tensor) else ("object", v) for k, v in st.items()}
    return out


def merge_groups(all_groups: list[list[dict]]) -> list[dict]:
    """Pipeline stages each see only their own parameters: a group's names are the union."""
    counts = {len(g) for g in all_groups}
    if len(counts) != 1:
        raise CheckpointError(f"ranks' optimizers have different numbers of parameter groups {sorted(counts)}; "
                              "build the optimizer the same way on every rank")
    merged = []
    for per_rank in zip(*all_groups):
        names: list[str] = []
        for g in per_rank:
            names += [n for n in g["params"] if n not in names]
        merged.append({**{k: v for k, v in per_rank[0].items() if k != "params"}, "params": names})
    return merged


def _gather(module: Any, state: dict, groups: list[dict], world: int, keep: Optional[Keep]) -> dict[str, Any]:
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (_describe(state), groups))
    desc: dict[str, dict] = {}
    for d, _ in everyone:
        for fqn, keys in d.items():
            desc.setdefault(fqn, {}).update({k: e for k, e in keys.items() if k not in desc.get(fqn, {})})
    firsts = {}
    for v, s in module.program.shards.items():
        if s.kind == "param" and s.fqn in desc and s.fqn not in firsts:
            firsts[s.fqn] = v
    sizes = {}
    for fqn, keys in desc.items():
        for key, (kind, *info) in keys.items():
            if kind != "object" and fqn in firsts:
                shape = module.program.shards[firsts[fqn]].layout.shape if kind == "shard" else info[0]
                sizes[(fqn, key)] = math.prod(shape) * getattr(torch, info[1].split(".")[-1]).itemsize
    kept = set(sizes) if keep is None else keep(sizes)
    out: dict[str, dict[str, Any]] = {}
    for v, s in module.program.shards.items():
        if s.kind != "param" or s.fqn in out or s.fqn not in desc:
            continue  # a tied weight's copies hold the same state
        mine = v in module.held_keys
        local = state.get(s.fqn, (None, {}))[1] if mine else {}
        entries: dict[str, Any] = {}
        for key in sorted(desc[s.fqn]):
            kind, *info = desc[s.fqn][key]
            if kind == "object":
                entries[key] = info[0]
                continue
            if mine and key not in local:
                raise CheckpointError(f"optimizer state {s.fqn!r}[{key!r}] exists on another rank but not on rank "
                                      f"{dist.get_rank()}; step the optimizer on every rank")
            dtype = getattr(torch, info[1].split(".")[-1])
            if kind == "shard":  # the module's own path from a piece to the whole (collective over the unit)
                whole = module.whole_tensor(v, local[key].detach() if mine else None, dtype)
            else:  # scalars (Adam's step): the same on every holder; a stage that lacks them is told
                whole = local[key].detach().clone() if mine else \
                    torch.empty(info[0], dtype=dtype, device=module.device)
                module.share_in_unit(v, whole)
            entries[key] = whole.detach().cpu().clone() if (s.fqn, key) in kept else \
                torch.empty(whole.shape, dtype=whole.dtype, device="meta")
            del whole
        out[s.fqn] = entries
    return {"state": out, "param_groups": merge_groups([g for _, g in everyone])}


def optimizer_algorithm(optimizer: Any) -> str:
    """The class of the optimizer that does the math, under the wrappers that hand it its state
    (nns.build_optimizer's ParallelOptimizer, accelerate's AcceleratedOptimizer): what a checkpoint
    records, so that one saved with SGD is not loaded into AdamW (whose step would find no
    `exp_avg`)."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = next((x for x in (getattr(optimizer, n, None) for n in ("inner", "optimizer", "_optimizer"))
                      if x is not None), None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_optimizer_matches(module: torch.nn.Module, optimizer: Any, saved_groups: list[dict]) -> list[str]:
    """Problems loading `saved_groups` into this optimizer would hit, found before anything changes."""
    if knows_plan(optimizer):
        return []
    index = param_index(module)
    if len(saved_groups) != len(optimizer.param_groups):
        return [f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one "
                f"{len(optimizer.param_groups)}"]
    problems = []
    for gi, (g, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        have = set(saved["params"])
        for p in g["params"]:
            if id(p) not in index:
                problems.append(f"group {gi}: the optimizer holds a tensor that is not a parameter of this module")
            elif index[id(p)][0] not in have:
                problems.append(f"group {gi}: parameter {index[id(p)][0]!r} is not in the checkpoint's group {gi}")
    return problems


def load_optimizer_state(module: torch.nn.Module, optimizer: Any, full: dict[str, Any]) -> None:
    """Each rank keeps the pieces of the whole state its own parameter shards need."""
    if knows_plan(optimizer):
        optimizer.load_full_state_dict(full)
        return
    problems = check_optimizer_matches(module, optimizer, full["param_groups"])
    if problems:
        raise CheckpointError("optimizer state does not fit this optimizer: " + "; ".join(problems))
    index = param_index(module)
    device = getattr(module, "unit_device", 0)
    sd = optimizer.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    for g, sg in zip(optimizer.param_groups, sd["param_groups"]):
        for p, i in zip(g["params"], sg["params"]):
            fqn, lay = index[id(p)]
            saved = full["state"].get(fqn)
            if saved is not None:
                new_state[i] = {k: _piece(v, lay, device) for k, v in saved.items()}
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": sg["params"]}
              for saved, sg in zip(full["param_groups"], sd["param_groups"])]
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def _piece(value: Any, lay: Optional[Layout], device: int) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if lay is not None and value.dim() > 0 and tuple(value.shape) == tuple(lay.shape):
        return lay.slice_full(value, device).clone()
    return value.clone()


def read_optimizer_state(module: Any, optimizer: Any, saved: dict[str, dict[str, Optional[tuple[int, ...]]]],
                         read_box: Callable[[str, Box], torch.Tensor], read_whole: Callable[[str], Any],
                         groups: list[dict], name_of: Callable[[str, str], str]) -> None:
    """Install this rank's pieces of a saved optimizer state. `saved` gives per parameter and key
    the whole shape of a stored tensor (None for a stored value); a tensor shaped like the
    parameter is read box by box for the piece (or ZeRO chunk) this rank holds."""

    def state_of(slot: Any) -> dict[str, Any]:
        out = {}
        for key, shape in saved.get(slot.fqn, {}).items():
            name = name_of(slot.fqn, key)
            if shape is not None and tuple(shape) == slot.shape and len(shape) >= 1:
                out[key] = read_piece(slot.region, lambda box, n=name: read_box(n, box), None, slot.lo, slot.hi)
            else:
                out[key] = read_whole(name)
        return out

    slots = optimizer_slots(module, optimizer)  # plain optimizers: in param_groups order
    if knows_plan_pieces(optimizer):
        for slot in slots:
            optimizer.load_local_state(slot.fqn, state_of(slot))
        for g, saved in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        return
    sd = optimizer.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    order = iter(slots)
    for g, sg in zip(optimizer.param_groups, sd["param_groups"]):
        for p, i in zip(g["params"], sg["params"]):
            st = state_of(next(order))
            new_state[i] = {k: (v.reshape(p.shape).clone() if torch.is_tensor(v) and v.dim() >= 1
                                and v.numel() == p.numel() else v) for k, v in st.items()}
    new_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": sg["params"]}
                  for saved, sg in zip(groups, sd["param_groups"])]
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
