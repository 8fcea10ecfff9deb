"""`save`: every rank writes the pieces of the state it is the first holder of, as they are in its
memory (no whole tensor is gathered), and rank 0 publishes the directory atomically once every
rank reports its file written and synced and the pieces cover every tensor exactly once.

With `background=True` the pieces are first copied into host memory (the only part that runs on
the training thread, with the collective start and the sums of partial pieces); a thread writes
them and meets the other ranks' threads through the process group's store, never through a
collective, so it cannot interleave with the training thread's collectives."""
from __future__ import annotations

import io
import itertools
import os
import pickle
import secrets
import shutil
import time
from typing import Any, Iterable, Iterator, Optional, Union

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
from nnscaler_plugins.checkpoint.background import SaveHandle, start_in_background, wait_for_saves
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
    rng_file,
    stored_tensor_entry,
    write_metadata,
)
from nnscaler_plugins.checkpoint.optimizer_state import group_names, merge_groups, optimizer_algorithm
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
            "world_size": plan.world_size, "unit_size": plan.unit_size, "dp": plan.dp, "precision": plan.precision,
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


def _model_pieces(module: Any, rank: int) -> Iterator[tuple]:
    """(key, whole shape, data, region, lo, hi, converted) for every model piece this rank writes;
    partial sums are summed on the way (collective over the unit, so iterate on every rank)."""
    for slot in model_slots(module, rank):
        if slot.writes:
            data = model_data(module, slot)
            p = slot.piece
            converted = slot.key is not None and data.data_ptr() != module.local_tensor(slot.key).data_ptr()
            yield f"model/{p.name}", p.shape, data, p.region, p.lo, p.hi, converted
    for v in partial_keys(module):  # partial sums are summed first (collective over the unit)
        s = module.program.shards[v]
        dtype = module.graph.meta(s.value).dtype
        local = module.local_tensor(v).detach().to(dtype) if v in module.held_keys else None
        whole = module.whole_tensor(v, local, dtype).detach().cpu()
        if module.dp_rank == 0 and module.unit_device == s.layout.group[0]:
            yield f"model/{s.fqn}", tuple(s.layout.shape), whole, Region.whole(whole.shape), 0, whole.numel(), True


def _optimizer_pieces(module: Any, optimizer: Any, rank: int, objects: dict[str, Any]) -> Iterator[tuple]:
    """The optimizer's pieces this rank writes, like `_model_pieces`; its per-parameter values (a
    step count) go into `objects`."""
    for slot in optimizer_slots(module, optimizer, rank):
        if not slot.writes:
            continue
        for key, value in slot.state.items():
            k = optim_key(slot.fqn, key)
            if is_piece_tensor(value, slot):
                data = value.detach()
                yield k, slot.shape, data.cpu(), slot.region, slot.lo, slot.hi, data.device.type != "cpu"
            elif slot.lo == 0:  # per-parameter values (a step count): once, by the first chunk's writer
                objects[k] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _off_device(pieces: Iterator[tuple]) -> list[tuple]:
    """Every piece copied into host memory of its own, so training may change the originals while
    a background thread writes the copies."""
    out = []
    for key, shape, data, region, lo, hi, converted in pieces:
        copy = data.detach().to("cpu", copy=True) if data.device.type == "cpu" or not torch.cuda.is_available() \
            else data.detach().to("cpu", non_blocking=True)
        out.append((key, shape, copy, region, lo, hi, converted))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies have landed before the thread reads them
    return out


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


def save(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *, background: bool = False,
         sync_timeout_s: float = 600.0, **extra: Any) -> Union[str, SaveHandle]:
    """Write a sharded checkpoint directory at `path` (collective: call on every rank, same path).

    Each rank writes the pieces of the model and optimizer state it holds (each element once,
    whatever the plan's replication), so saving needs no memory beyond those pieces; the
    checkpoint loads under any plan or world size. `extra` (step counters, RNG and scheduler
    states, anything picklable) is taken from rank 0 and returned by `load`; each rank's random
    number generator states are kept too (`load` restores them under the same plan and world
    size). The previous checkpoint at `path` stays whole until the new one is complete. A rank that
    does not call save within `sync_timeout_s` makes the others fail with a message naming it, not
    hang. Returns the checkpoint directory.

    `background=True`: the state is copied off the device into host memory now, and written, synced
    and published by a thread while training goes on; returns a `SaveHandle` whose `wait()` returns
    the directory (or raises what went wrong). The copy costs host memory for this rank's pieces
    until the write ends. A later save (or load) first waits for this one. A process killed during
    the write leaves the previous checkpoint at `path` (and any other) intact, and `latest` never
    returns the unfinished one.
    """
    wait_for_saves()  # one save at a time: a second waits for the first (and raises what it raised)
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
    job = _Job(final, temp_dir(final, token), token, round_no, rank, world_size, sync_timeout_s)
    job.plan = plan_summary(module)
    job.optimizer_class = None if optimizer is None else type(optimizer).__qualname__
    job.optimizer_algorithm = None if optimizer is None else optimizer_algorithm(optimizer)
    job.extra_keys = sorted(extra)
    try:
        os.makedirs(job.tmp, exist_ok=True)
        pieces = _model_pieces(module, rank)
        if optimizer is not None:
            pieces = itertools.chain(pieces, _optimizer_pieces(module, optimizer, rank, job.objects))
            job.groups = group_names(module, optimizer)
        job.aliases = aliases(module)
        job.pieces = _off_device(pieces) if background else pieces  # in place: written as they come
        job.rng = pickle.dumps(rng_state(module))
        if rank == 0:
            job.extra = _pickled(extra)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the job, then raised everywhere
        job.status = f"{type(e).__name__}: {e}"
    if background:
        return start_in_background(job.run, final)
    return job.run()


def _pickled(extra: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(extra), buf)
    return buf.getvalue()


def rng_state(module: Any = None) -> dict[str, Any]:
    """This process's random number generator states (torch's CPU generator, and the current CUDA
    device's where there is one), and the module's per-piece random stream where it has one."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    stream = module.random_stream() if hasattr(module, "random_stream") else None
    if stream is not None:
        out["pieces"] = stream
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


class _Job:
    """One save after its collective start: this rank's pieces (or a generator of them) and what the
    metadata needs. `run` writes them, meets the other ranks through the store (never a collective,
    so a thread can run it while the training thread communicates), and rank 0 publishes."""

    def __init__(self, final: str, tmp: str, token: str, round_no: int, rank: int, world_size: int,
                 timeout_s: float):
        self.final, self.tmp, self.token, self.round_no = final, tmp, token, round_no
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.status = "ok"
        self.pieces: Iterable[tuple] = ()
        self.objects: dict[str, Any] = {}
        self.groups: Any = None
        self.aliases: dict[str, str] = {}
        self.plan: dict[str, Any] = {}
        self.optimizer_class: Optional[str] = None
        self.optimizer_algorithm: Optional[str] = None
        self.extra_keys: list[str] = []
        self.extra: Optional[bytes] = None
        self.rng: bytes = b""

    def _write(self) -> dict[str, Any]:
        file = rank_file(self.rank)
        writer = PieceWriter(os.path.join(self.tmp, file))
        try:
            out = _Written(writer, file)
            for piece in self.pieces:
                out.piece(*piece)
            digest = writer.close()
            writer = None
        finally:
            if writer is not None:
                writer.abort()
        rng_path = os.path.join(self.tmp, rng_file(self.rank))
        _write_bytes(rng_path, self.rng)
        if self.rank == 0:
            _write_bytes(os.path.join(self.tmp, EXTRA_FILE), self.extra or b"")
        return {"digest": digest, "rng": file_digest(rng_path), "tensors": out.tensors, "objects": self.objects,
                "groups": self.groups, "peak_piece_bytes": out.peak_piece_bytes}

    def run(self) -> str:
        status, report = self.status, {}
        if status == "ok":
            try:
                report = self._write()
            except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised everywhere
                status = f"{type(e).__name__}: {e}"
        self.pieces = ()  # the copies are written: free them before waiting for the other ranks
        written = exchange(self.round_no, "written", (status, report), self.timeout_s, WHAT)
        failed = {r: s for r, (s, _) in enumerate(written) if s != "ok"}
        if not failed and self.rank == 0:
            try:
                self._publish([w for _, w in written])
            except Exception as e:  # noqa: BLE001
                failed[0] = f"{type(e).__name__}: {e}"
        if failed and self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        published = exchange(self.round_no, "done", failed.get(0, "ok") if self.rank == 0 else "ok", self.timeout_s,
                             WHAT)
        if published[0] != "ok":
            failed.setdefault(0, published[0])
        if failed:
            detail = "; ".join(f"rank {r}: {s}" for r, s in sorted(failed.items()))
            raise CheckpointError(f"{WHAT} to {self.final} failed ({detail}); the previous checkpoint there, if any, "
                                  "is untouched")
        return self.final

    def _publish(self, reports: list[dict]) -> None:
        """Rank 0: check the pieces cover the state, write the metadata, swap the directory in."""
        tmp = self.tmp
        tensors, problems = _metadata_parts(reports)
        if problems:
            raise CheckpointError("the pieces written do not cover the state exactly once: " + "; ".join(problems[:5]))
        files = {rank_file(r): w["digest"] for r, w in enumerate(reports)}
        files.update({rng_file(r): w["rng"] for r, w in enumerate(reports)})
        unseen = [f for f in files if not os.path.exists(os.path.join(tmp, f))]
        if unseen:
            raise CheckpointError(f"rank 0 cannot see {unseen[:4]} that other ranks wrote under {tmp}: the path "
                                  "must be on a file system every rank shares")
        with_optimizer = self.optimizer_class is not None
        meta_model, meta_optim = _model_and_optimizer_meta(self.aliases, tensors, reports, with_optimizer)
        if meta_optim is not None:
            objects = {k: v for w in reports for k, v in w["objects"].items()}
            objects[OPTIM_GROUPS_KEY] = meta_optim.pop("param_groups")
            obj_path = os.path.join(tmp, OBJECTS_FILE)
            torch.save(objects, obj_path)
            fsync_file(obj_path)
            files[OBJECTS_FILE] = file_digest(obj_path)
        files[EXTRA_FILE] = file_digest(os.path.join(tmp, EXTRA_FILE))
        write_metadata(tmp, {"format": FORMAT, "version": VERSION, "world_size": self.world_size, "plan": self.plan,
                             "model": meta_model, "optimizer": meta_optim, "optimizer_class": self.optimizer_class,
                             "optimizer_algorithm": self.optimizer_algorithm,
                             "files": files, "extra_keys": self.extra_keys, "saved_at": time.time(),
                             "peak_piece_bytes": [w["peak_piece_bytes"] for w in reports]})
        fsync_dir(tmp)
        swap_into_place(tmp, self.final, self.token)
        remove_stale(self.final)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _model_and_optimizer_meta(tied: dict[str, str], tensors: dict, reports: list[dict], with_optimizer: bool
                              ) -> tuple[dict, Any]:
    model_meta: dict[str, Any] = {}
    for key, (shape, dtype, pieces) in tensors.items():
        if key.startswith("model/"):
            model_meta[key[len("model/"):]] = stored_tensor_entry(shape, getattr(torch, dtype), pieces)
    for alias, name in tied.items():
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


