"""`save`: every rank gathers whole tensors, writes the ones it owns, and rank 0 publishes the
directory atomically once every rank reports its file written and synced."""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from typing import Any, Optional

import torch

from nnscaler_plugins.checkpoint.agreement import (
    begin_round,
    exchange,
    finish_round,
    world,
)
from nnscaler_plugins.checkpoint.atomic import (
    METADATA,
    fsync_dir,
    fsync_file,
    remove_stale,
    swap_into_place,
    temp_dir,
)
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.format import (
    EXTRA_FILE,
    FORMAT,
    OPTIM_GROUPS_KEY,
    VERSION,
    file_digest,
    model_key,
    object_entry,
    optim_key,
    rank_file,
    tensor_entry,
    write_metadata,
)
from nnscaler_plugins.checkpoint.model_state import full_model_state
from nnscaler_plugins.checkpoint.optimizer_state import full_optimizer_state
from nnscaler_plugins.checkpoint.ownership import assign_owners, loads

WHAT = "nns.checkpoint.save"


def plan_summary(module: Any) -> dict[str, Any]:
    """What the metadata records about the saving plan (for messages and for people, not needed to load)."""
    plan = getattr(module, "plan", None)
    if plan is None:
        return {"strategy": None, "model_class": type(module).__name__}
    return {"strategy": plan.strategy, "graph_fingerprint": plan.graph_fingerprint, "model_class": plan.model_class,
            "world_size": plan.world_size, "unit_size": plan.unit_size, "dp": plan.dp,
            "pipeline_stages": None if plan.pipeline is None else plan.pipeline.num_stages,
            "options": {k: v for k, v in plan.options.items() if isinstance(v, (int, float, str, bool))}}


def _model_items(model: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stored model tensors by file key, and tied names (stored once) -> the name that is stored."""
    items: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in model.items():
        if id(t) in first_name:
            aliases[name] = first_name[id(t)]
        else:
            first_name[id(t)] = name
            items[model_key(name)] = t
    return items, aliases


def _nbytes(items: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: t.numel() * t.element_size() for k, t in items.items()}


def _optimizer_keep(model_items: dict[str, torch.Tensor], rank: int, world_size: int):
    """What this rank keeps of the optimizer state: what it will write (see ownership.py)."""
    start = loads(assign_owners(_nbytes(model_items), world_size), _nbytes(model_items), world_size)

    def keep(sizes: dict[tuple[str, str], int]) -> set[tuple[str, str]]:
        owners = assign_owners({optim_key(n, k): b for (n, k), b in sizes.items()}, world_size, start)
        return {(n, k) for (n, k) in sizes if owners[optim_key(n, k)] == rank}
    return keep


def _layout_files(model: dict[str, torch.Tensor], optim: Optional[dict[str, Any]], world_size: int
                  ) -> tuple[dict[str, tuple[Any, int]], dict[str, Any], Optional[dict[str, Any]]]:
    """Every stored item with its owning rank, and the metadata entries naming where each lives."""
    items, aliases = _model_items(model)
    owners = assign_owners(_nbytes(items), world_size)
    placed: dict[str, tuple[Any, int]] = {k: (t, owners[k]) for k, t in items.items()}
    model_meta = {name: {"alias_of": aliases[name]} if name in aliases else
                  tensor_entry(t, rank_file(owners[model_key(name)])) for name, t in model.items()}
    if optim is None:
        return placed, model_meta, None
    tensors = {optim_key(n, k): v for n, keys in optim["state"].items() for k, v in keys.items()
               if isinstance(v, torch.Tensor)}
    owners.update(assign_owners(_nbytes(tensors), world_size, loads(owners, _nbytes(items), world_size)))
    state_meta: dict[str, Any] = {}
    for name, keys in optim["state"].items():
        state_meta[name] = {}
        for key, v in keys.items():
            k = optim_key(name, key)
            if isinstance(v, torch.Tensor):
                placed[k] = (v, owners[k])
                state_meta[name][key] = tensor_entry(v, rank_file(owners[k]))
            else:  # small Python values: rank 0
                placed[k] = (v, 0)
                state_meta[name][key] = object_entry(rank_file(0))
    placed[OPTIM_GROUPS_KEY] = (optim["param_groups"], 0)
    optim_meta = {"groups": [list(g["params"]) for g in optim["param_groups"]], "state": state_meta,
                  "param_groups_file": rank_file(0)}
    return placed, model_meta, optim_meta


def _mine(placed: dict[str, tuple[Any, int]], rank: int) -> dict[str, Any]:
    out = {}
    for k, (v, owner) in placed.items():
        if owner == rank:
            if isinstance(v, torch.Tensor) and v.is_meta:
                raise RuntimeError(f"{k} is owned by rank {rank} but was not kept when gathered")
            out[k] = v.contiguous() if isinstance(v, torch.Tensor) else v
    return out


def _refusal(final: str) -> str:
    """Why `final` must not be replaced by a checkpoint ("" when it may): only an earlier checkpoint
    or an empty directory is ever swapped out, never a file or a directory of other things."""
    if os.path.isfile(final):
        return f"{final} is a file; a checkpoint is a directory, choose another path"
    if os.path.isdir(final) and os.listdir(final) and not os.path.exists(os.path.join(final, METADATA)):
        return (f"{final} is a directory that is not an nnscaler checkpoint; refusing to replace it, "
                "choose a new path (or an earlier checkpoint's)")
    return ""


def save(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *,
         sync_timeout_s: float = 600.0, **extra: Any) -> str:
    """Write a sharded checkpoint directory at `path` (collective: call on every rank, same path).

    Model and optimizer state are stored as whole tensors, each written by one rank, so the
    checkpoint loads under any plan or world size. `extra` (step counters, RNG and scheduler
    states, anything picklable) is taken from rank 0 and returned by `load`. The previous
    checkpoint at `path` stays whole until the new one is complete. A rank that does not call
    save within `sync_timeout_s` makes the others fail with a message naming it, not hang.
    Returns the checkpoint directory.
    """
    rank, world_size = world()
    final = os.path.abspath(os.fspath(path))
    round_no = begin_round()
    begun = exchange(round_no, "begin", (final, secrets.token_hex(6), _refusal(final)), sync_timeout_s, WHAT)
    finish_round()
    refusals = sorted({r for _, _, r in begun if r})
    if refusals:
        raise CheckpointError(f"{WHAT}: {refusals[0]}")
    paths = sorted({p for p, _, _ in begun})
    if len(paths) > 1:
        raise CheckpointError(f"{WHAT}: ranks passed different paths {paths}; pass the same path on every rank "
                              "(a directory every rank can reach), and call save on every rank each time (a rank that "
                              "skipped an earlier save meets the others at the next one)")
    token = begun[0][1]
    tmp = temp_dir(final, token)

    model_state = full_model_state(module)  # collectives: every rank takes part
    optim_state = None if optimizer is None else full_optimizer_state(
        module, optimizer, keep=_optimizer_keep(_model_items(model_state)[0], rank, world_size))
    status, digest = "ok", None
    try:
        placed, model_meta, optim_meta = _layout_files(model_state, optim_state, world_size)
        os.makedirs(tmp, exist_ok=True)
        file = os.path.join(tmp, rank_file(rank))
        torch.save(_mine(placed, rank), file)
        fsync_file(file)
        digest = file_digest(file)
        if rank == 0:
            extra_path = os.path.join(tmp, EXTRA_FILE)
            torch.save(dict(extra), extra_path)
            fsync_file(extra_path)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised everywhere
        status = f"{type(e).__name__}: {e}"
    # Every rank must have placed the same tensors on the same owners, or files and metadata disagree.
    listing = hashlib.sha256(repr(sorted((k, owner, tuple(v.shape) if isinstance(v, torch.Tensor) else None)
                                         for k, (v, owner) in placed.items())).encode()).hexdigest() \
        if status == "ok" else None
    written = exchange(round_no, "written", (status, digest, listing), sync_timeout_s, WHAT)
    failed = {r: s for r, (s, _, _) in enumerate(written) if s != "ok"}
    if not failed and len({lst for _, _, lst in written}) > 1:
        failed = {r: "ranks gathered different tensors to save (a full_state_dict that is not the whole state on "
                     "every rank?)" for r in range(world_size)}
    if not failed and rank == 0:
        try:
            files = {rank_file(r): d for r, (_, d, _) in enumerate(written)}
            unseen = [f for f in files if not os.path.exists(os.path.join(tmp, f))]
            if unseen:
                raise CheckpointError(f"rank 0 cannot see {unseen[:4]} that other ranks wrote under {tmp}: the path "
                                      "must be on a file system every rank shares")
            files[EXTRA_FILE] = file_digest(os.path.join(tmp, EXTRA_FILE))
            write_metadata(tmp, {"format": FORMAT, "version": VERSION, "world_size": world_size,
                                 "plan": plan_summary(module), "model": model_meta, "optimizer": optim_meta,
                                 "optimizer_class": None if optimizer is None else type(optimizer).__qualname__,
                                 "files": files, "extra_keys": sorted(extra)})
            fsync_dir(tmp)
            swap_into_place(tmp, final, token)
            remove_stale(final)
        except Exception as e:  # noqa: BLE001
            failed[0] = f"{type(e).__name__}: {e}"
    if failed and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    published = exchange(round_no, "done", failed.get(0, "ok") if rank == 0 else "ok", sync_timeout_s, WHAT)
    if published[0] != "ok":
        failed.setdefault(0, published[0])
    if failed:
        detail = "; ".join(f"rank {r}: {s}" for r, s in sorted(failed.items()))
        raise CheckpointError(f"{WHAT} to {final} failed ({detail}); the previous checkpoint there, if any, is "
                              "untouched")
    return final
