"""`save`: every rank writes the pieces of the state it is the first holder of, as they are in its
memory (no whole tensor is gathered), and rank 0 publishes the directory atomically once every
rank reports its file written and synced and the pieces cover every tensor exactly once."""
from __future__ import annotations

import os
import secrets
import shutil
from typing import Any

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
    OBJECTS_FILE,
    OPTIM_GROUPS_KEY,
    VERSION,
    PieceWriter,
    file_digest,
    object_entry,
    optim_key,
    piece_entry,
    rank_file,
    stored_tensor_entry,
    write_metadata,
)
from nnscaler_plugins.checkpoint.optimizer_state import group_names, merge_groups
from nnscaler_plugins.checkpoint.pieces import (
    aliases,
    is_piece_tensor,
    model_data,
    model_slots,
    optimizer_slots,
    partial_keys,
)
from nnscaler_plugins.checkpoint.regions import Region

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


class _Written:
    """What one rank wrote: per stored tensor its shape, dtype and pieces; small values by key."""

    def __init__(self, writer: PieceWriter, file: str):
        self.writer, self.file = writer, file
        self.tensors: dict[str, tuple[list[int], str, list[dict]]] = {}
        self.objects: dict[str, Any] = {}
        self.peak_piece_bytes = 0  # the largest copy made to write a piece (a dtype conversion)

    def piece(self, key: str, shape: tuple[int, ...], data: torch.Tensor, region: Region, lo: int, hi: int,
              copied: bool) -> None:
        if copied:
            self.peak_piece_bytes = max(self.peak_piece_bytes, data.numel() * data.element_size())
        offset = self.writer.add(data)
        entry = self.tensors.setdefault(key, (list(shape), str(data.dtype).removeprefix("torch."), []))
        entry[2].append(piece_entry(self.file, offset, region, lo, hi))


def _write_model(module: Any, out: _Written, rank: int) -> None:
    for slot in model_slots(module, rank):
        if slot.writes:
            data = model_data(module, slot)
            p = slot.piece
            copied = slot.key is not None and data.data_ptr() != module.local_tensor(slot.key).data_ptr()
            out.piece(f"model/{p.name}", p.shape, data, p.region, p.lo, p.hi, copied)
    for v in partial_keys(module):  # partial sums are summed first (collective over the unit)
        s = module.program.shards[v]
        dtype = module.graph.meta(s.value).dtype
        local = module.local_tensor(v).detach().to(dtype) if v in module.held_keys else None
        whole = module.whole_tensor(v, local, dtype).detach().cpu()
        if module.dp_rank == 0 and module.unit_device == s.layout.group[0]:
            out.piece(f"model/{s.fqn}", tuple(s.layout.shape), whole, Region.whole(whole.shape), 0, whole.numel(),
                      True)


def _write_optimizer(module: Any, optimizer: Any, out: _Written, rank: int) -> None:
    for slot in optimizer_slots(module, optimizer, rank):
        if not slot.writes:
            continue
        for key, value in slot.state.items():
            k = optim_key(slot.fqn, key)
            if is_piece_tensor(value, slot):
                data = value.detach()
                out.piece(k, slot.shape, data.cpu(), slot.region, slot.lo, slot.hi, data.device.type != "cpu")
            elif slot.lo == 0:  # per-parameter values (a step count): once, by the first chunk's writer
                out.objects[k] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _metadata_parts(written: list[dict]) -> tuple[dict, Any]:
    """The model's metadata entries from every rank's pieces; problems if they do not cover each
    tensor exactly once."""
    tensors: dict[str, tuple[list[int], str, list[dict]]] = {}
    for w in written:
        for key, (shape, dtype, pieces) in w["tensors"].items():
            tensors.setdefault(key, (shape, dtype, []))[2].extend(pieces)
    problems = []
    for key, (shape, _, pieces) in tensors.items():
        have, want = sum(p["hi"] - p["lo"] for p in pieces), 1
        for n in shape:
            want *= n
        if have != want:
            problems.append(f"{key}: the ranks wrote {have} of its {want} elements")
    return tensors, problems


def save(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *,
         sync_timeout_s: float = 600.0, **extra: Any) -> str:
    """Write a sharded checkpoint directory at `path` (collective: call on every rank, same path).

    Each rank writes the pieces of the model and optimizer state it holds (each element once,
    whatever the plan's replication), so saving needs no memory beyond those pieces; the
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

    status, report = "ok", {}
    writer = None
    try:
        os.makedirs(tmp, exist_ok=True)
        file = rank_file(rank)
        writer = PieceWriter(os.path.join(tmp, file))
        out = _Written(writer, file)
        _write_model(module, out, rank)
        groups = None
        if optimizer is not None:
            _write_optimizer(module, optimizer, out, rank)
            groups = group_names(module, optimizer)
        digest = writer.close()
        writer = None
        if rank == 0:
            extra_path = os.path.join(tmp, EXTRA_FILE)
            torch.save(dict(extra), extra_path)
            fsync_file(extra_path)
        report = {"digest": digest, "tensors": out.tensors, "objects": out.objects, "groups": groups,
                  "peak_piece_bytes": out.peak_piece_bytes}
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised everywhere
        status = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.abort()
    written = exchange(round_no, "written", (status, report), sync_timeout_s, WHAT)
    failed = {r: s for r, (s, _) in enumerate(written) if s != "ok"}
    if not failed and rank == 0:
        try:
            reports = [w for _, w in written]
            tensors, problems = _metadata_parts(reports)
            if problems:
                raise CheckpointError("the pieces written do not cover the state exactly once: " + "; ".join(problems[:5]))
            files = {rank_file(r): w["digest"] for r, w in enumerate(reports)}
            unseen = [f for f in files if not os.path.exists(os.path.join(tmp, f))]
            if unseen:
                raise CheckpointError(f"rank 0 cannot see {unseen[:4]} that other ranks wrote under {tmp}: the path "
                                      "must be on a file system every rank shares")
            meta_model, meta_optim = _model_and_optimizer_meta(module, tensors, reports, optimizer is not None)
            if meta_optim is not None:
                objects = {k: v for w in reports for k, v in w["objects"].items()}
                objects[OPTIM_GROUPS_KEY] = meta_optim.pop("param_groups")
                obj_path = os.path.join(tmp, OBJECTS_FILE)
                torch.save(objects, obj_path)
                fsync_file(obj_path)
                files[OBJECTS_FILE] = file_digest(obj_path)
            files[EXTRA_FILE] = file_digest(os.path.join(tmp, EXTRA_FILE))
            write_metadata(tmp, {"format": FORMAT, "version": VERSION, "world_size": world_size,
                                 "plan": plan_summary(module), "model": meta_model, "optimizer": meta_optim,
                                 "optimizer_class": None if optimizer is None else type(optimizer).__qualname__,
                                 "files": files, "extra_keys": sorted(extra),
                                 "peak_piece_bytes": [w["peak_piece_bytes"] for w in reports]})
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


def _model_and_optimizer_meta(module: Any, tensors: dict, reports: list[dict], with_optimizer: bool
                              ) -> tuple[dict, Any]:
    model_meta: dict[str, Any] = {}
    for key, (shape, dtype, pieces) in tensors.items():
        if key.startswith("model/"):
            model_meta[key[len("model/"):]] = stored_tensor_entry(shape, getattr(torch, dtype), pieces)
    for alias, name in aliases(module).items():
        model_meta[alias] = {"alias_of": name}
    if not with_optimizer:
        return model_meta, None
    groups = merge_groups([w["groups"] for w in reports])
    state: dict[str, dict[str, Any]] = {n: {} for g in groups for n in g["params"]}
    for key, (shape, dtype, pieces) in tensors.items():
        if key.startswith("optim/"):
            name, k = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[k] = stored_tensor_entry(shape, getattr(torch, dtype), pieces)
    for w in reports:
        for key in w["objects"]:
            name, k = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[k] = object_entry(OBJECTS_FILE)
    return model_meta, {"groups": [list(g["params"]) for g in groups], "state": state,
                        "param_groups_file": OBJECTS_FILE, "param_groups": groups}


def _refusal(final: str) -> str:
    """Why `final` must not be replaced by a checkpoint ("" when it may): only an earlier checkpoint
    or an empty directory is ever swapped out, never a file or a directory of other things."""
    if os.path.isfile(final):
        return f"{final} is a file; a checkpoint is a directory, choose another path"
    if os.path.isdir(final) and os.listdir(final) and not os.path.exists(os.path.join(final, METADATA)):
        return (f"{final} is a directory that is not an nnscaler checkpoint; refusing to replace it, "
                "choose a new path (or an earlier checkpoint's)")
    return ""


