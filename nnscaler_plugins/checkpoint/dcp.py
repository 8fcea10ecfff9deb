"""torch.distributed.checkpoint (DCP) directories: written by `export_dcp`, read by `load`.

DCP is the format torchtitan and FSDP2 write. Its unit is a chunk: a box of a whole tensor
(offsets and sizes) stored by one rank. Our pieces are boxes too (regions.py), so `export_dcp`
hands DCP's own planner and file writer each rank's pieces as chunks (no gathering, each element
once), and reading a DCP directory asks, for every box a rank needs, the chunks that overlap it.
Model tensors are stored under the model's names at the top level (what `dcp_to_torch_save` turns
into an ordinary state dict); optimizer state under "optimizer.state.NAME.KEY" and the
parameter groups as bytes under "optimizer.param_groups".
"""
from __future__ import annotations

import io
import os
import secrets
import shutil
import warnings
from typing import Any, Optional

import torch

from nnscaler_plugins.checkpoint.agreement import (
    begin_round,
    exchange,
    finish_round,
    world,
)
from nnscaler_plugins.checkpoint.atomic import fsync_dir, sibling, swap_into_place
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.optimizer_state import (
    group_names,
    merge_groups,
    read_optimizer_state,
)
from nnscaler_plugins.checkpoint.pieces import (
    aliases,
    is_piece_tensor,
    model_data,
    model_slots,
    optimizer_slots,
    partial_keys,
)
from nnscaler_plugins.checkpoint.regions import (
    Box,
    Region,
    box_numel,
    box_slices,
    intersect,
)
from nnscaler_plugins.checkpoint.sources import WeightSource

DCP_METADATA = ".metadata"
OPTIM_STATE = "optimizer.state."
OPTIM_GROUPS = "optimizer.param_groups"
WHAT = "nns.checkpoint.export_dcp"


def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, DCP_METADATA)) and \
        not os.path.exists(os.path.join(path, "metadata.json"))


class _DcpReader:
    """Boxes of a DCP directory's tensors, from the chunks that overlap them (the last chunk read
    is kept, since a rank's boxes usually fall in one chunk)."""

    def __init__(self, directory: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        try:
            self.md = FileSystemReader(directory).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the DCP metadata of {directory}: {e}") from None
        self._last: Optional[tuple[Any, torch.Tensor]] = None

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {fqn: (tuple(m.size), m.properties.dtype) for fqn, m in self.md.state_dict_metadata.items()
                if isinstance(m, TensorStorageMetadata)}

    def _chunk(self, fqn: str, offsets: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        index = MetadataIndex(fqn, offsets)
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        info = self.md.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.directory}: {fqn} is stored with transforms {info.transform_descriptors} "
                                  "(compression?); this reader takes plain DCP chunks")
        with open(os.path.join(self.directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        self._last = (index, t)
        return t

    def read(self, fqn: str, box: Box) -> torch.Tensor:
        m = self.md.state_dict_metadata[fqn]
        out = torch.empty(tuple(e - s for s, e in box), dtype=m.properties.dtype)
        filled = 0
        for c in m.chunks:
            cbox = tuple((o, o + n) for o, n in zip(c.offsets, c.sizes))
            common = intersect(cbox, box)
            if common is None:
                continue
            out[box_slices(common, box)] = self._chunk(fqn, c.offsets)[box_slices(common, cbox)]
            filled += out[box_slices(common, box)].numel()
        if filled != out.numel():
            raise CheckpointError(f"{self.directory}: the chunks of {fqn} cover {filled} of the {out.numel()} "
                                  "elements asked for")
        return out

    def read_bytes(self, fqn: str) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.md.storage_data[MetadataIndex(fqn)]
        with open(os.path.join(self.directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def dcp_source(directory: str) -> Any:
    """A DCP directory's model tensors (everything outside "optimizer.") as a `WeightSource`."""
    reader = _DcpReader(directory)
    tensors = {n: v for n, v in reader.tensors().items() if not n.startswith("optimizer.")}
    source = WeightSource(directory, tensors, reader.read, "a torch.distributed.checkpoint directory")
    source.kind = "DCP checkpoint"
    return source


def load_dcp_optimizer(directory: str, module: Any, optimizer: Any) -> None:
    """This rank's pieces of the optimizer state `export_dcp` wrote."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata


    reader = _DcpReader(directory)
    md = reader.md.state_dict_metadata
    if OPTIM_GROUPS not in md:
        raise CheckpointError(f"{directory} holds no optimizer state in the layout export_dcp writes "
                              f"({OPTIM_GROUPS!r} is missing); load it without optimizer=")
    saved: dict[str, dict[str, Optional[tuple[int, ...]]]] = {}
    for key, m in md.items():
        if key.startswith(OPTIM_STATE):
            fqn, k = key[len(OPTIM_STATE):].rsplit(".", 1)
            saved.setdefault(fqn, {})[k] = None if isinstance(m, BytesStorageMetadata) else tuple(m.size)
    read_optimizer_state(module, optimizer, saved, reader.read,
                         lambda name: reader.read_bytes(name) if isinstance(md[name], BytesStorageMetadata)
                         else reader.read(name, tuple((0, n) for n in md[name].size)),
                         reader.read_bytes(OPTIM_GROUPS), lambda fqn, k: f"{OPTIM_STATE}{fqn}.{k}")


def _items(module: Any, optimizer: Any, rank: int) -> tuple[list, dict]:
    """This rank's DCP write items (one per box of its pieces) and the data each resolves to."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    items, data = [], {}

    def add_piece(fqn: str, shape: tuple[int, ...], flat: torch.Tensor, region: Region, lo: int, hi: int) -> None:
        for block, off, pairs in region.blocks(lo, hi):
            view = flat[off:off + box_numel(block)].view(tuple(e - s for s, e in block))
            for whole_box, piece_box in pairs:
                offsets = torch.Size(s for s, _ in whole_box)
                index = MetadataIndex(fqn, offsets)
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(e - s for s, e in whole_box)),
                    properties=TensorProperties(dtype=flat.dtype), size=torch.Size(shape))))
                data[index] = view[box_slices(piece_box, block)].contiguous()

    def add_bytes(fqn: str, value: Any) -> None:
        index = MetadataIndex(fqn)
        items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        data[index] = buf

    tied = aliases(module)
    names_of: dict[str, list[str]] = {}
    for alias, name in tied.items():
        names_of.setdefault(name, []).append(alias)
    for slot in model_slots(module, rank):
        if slot.writes:
            p = slot.piece
            flat = model_data(module, slot).cpu()
            for name in [p.name] + names_of.get(p.name, []):  # tied names each get a copy, as in a state dict
                add_piece(name, p.shape, flat, p.region, p.lo, p.hi)
    for v in partial_keys(module):
        s = module.program.shards[v]
        dtype = module.graph.meta(s.value).dtype
        local = module.local_tensor(v).detach().to(dtype) if v in module.held_keys else None
        whole = module.whole_tensor(v, local, dtype).detach().cpu()
        if module.dp_rank == 0 and module.unit_device == s.layout.group[0]:
            for name in [s.fqn] + names_of.get(s.fqn, []):
                add_piece(name, tuple(whole.shape), whole.reshape(-1), Region.whole(whole.shape), 0, whole.numel())
    if optimizer is not None:
        for slot in optimizer_slots(module, optimizer, rank):
            if not slot.writes:
                continue
            for key, value in slot.state.items():
                name = f"{OPTIM_STATE}{slot.fqn}.{key}"
                if is_piece_tensor(value, slot):
                    add_piece(name, slot.shape, value.detach().cpu().reshape(-1), slot.region, slot.lo, slot.hi)
                elif slot.lo == 0 and isinstance(value, torch.Tensor):
                    add_piece(name, tuple(value.shape), value.detach().cpu().reshape(-1),
                              Region.whole(value.shape), 0, value.numel())
                elif slot.lo == 0:
                    add_bytes(name, value)
    return items, data


def export_dcp(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *,
               sync_timeout_s: float = 600.0) -> str:
    """Write the module's (and optimizer's) state as a torch.distributed.checkpoint directory
    (collective: call on every rank). Each rank hands DCP the pieces it writes in `save`, as
    chunks, so nothing is gathered; DCP's planner checks that the chunks cover every tensor. The
    directory appears at `path` only once complete (the previous one stays whole until then).
    `nns.checkpoint.load(path, module, optimizer)` reads it back under any plan."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    rank, size = world()
    final = os.path.abspath(os.fspath(path))
    round_no = begin_round()
    begun = exchange(round_no, "begin-dcp", (final, secrets.token_hex(6)), sync_timeout_s, WHAT)
    finish_round()
    if len({p for p, _ in begun}) > 1:
        raise CheckpointError(f"{WHAT}: ranks passed different paths {sorted({p for p, _ in begun})}")
    token = begun[0][1]
    tmp = sibling(final, "saving", token)
    if os.path.isfile(final) or (os.path.isdir(final) and os.listdir(final) and not is_dcp_dir(final)):
        raise CheckpointError(f"{WHAT}: {final} exists and is not a DCP checkpoint; choose another path")
    items, data = _items(module, optimizer, rank)
    if optimizer is not None:
        groups = group_names(module, optimizer)
        everyone = [groups] if size == 1 else exchange(round_no, "groups-dcp", groups, sync_timeout_s, WHAT)
        if rank == 0:
            from torch.distributed.checkpoint.metadata import MetadataIndex
            from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

            index = MetadataIndex(OPTIM_GROUPS)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            buf = io.BytesIO()
            torch.save(merge_groups(everyone), buf)
            buf.seek(0)
            data[index] = buf

    class _Pieces(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(list(items), planner_data={})
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            return data[write_item.index]

    os.makedirs(tmp, exist_ok=True)
    status = "ok"
    try:
        with warnings.catch_warnings():  # one process: DCP says it assumes so
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=FileSystemWriter(tmp, sync_files=True), planner=_Pieces(),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
    except Exception as e:  # noqa: BLE001 - told to every rank
        status = f"{type(e).__name__}: {e}"
    done = exchange(round_no, "written-dcp", status, sync_timeout_s, WHAT)
    failed = [f"rank {r}: {s}" for r, s in enumerate(done) if s != "ok"]
    if not failed and rank == 0:
        try:
            fsync_dir(tmp)
            swap_into_place(tmp, final, token)
        except Exception as e:  # noqa: BLE001
            failed.append(f"rank 0: {type(e).__name__}: {e}")
    if rank == 0 and failed:
        shutil.rmtree(tmp, ignore_errors=True)
    published = exchange(round_no, "done-dcp", "; ".join(failed) if rank == 0 else "", sync_timeout_s, WHAT)
    if published[0] or failed:
        raise CheckpointError(f"{WHAT} to {final} failed ({published[0] or '; '.join(failed)}); the previous "
                              "directory there, if any, is untouched")
    return final
