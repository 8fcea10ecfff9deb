"""The on-disk layout of a checkpoint directory, and reading it back with clear errors.

    CKPT/metadata.json       format and version, the saving plan (strategy, fingerprint, world
                             size), every tensor's name, whole shape and dtype and the pieces it is
                             stored in (file, byte offset, which elements), the files' sizes and
                             SHA-256, the optimizer's groups and extra's keys
    CKPT/rank-00000.bin ...  one raw file per saving rank: the pieces of tensors it holds, as they
                             are in its memory (row-major, 64-byte aligned), never gathered first
    CKPT/objects.pt          small values: the optimizer's parameter groups and per-parameter
                             scalars (Adam's step), with their exact Python types (weights_only-safe)
    CKPT/extra.pt            the caller's extra values (pickled)
    CKPT/rng-00000.pt ...    each saving rank's random number generator states (pickled)

A piece is a region of the whole tensor (per dim, the ranges a device holds under its layout)
and optionally a flat range of it (a ZeRO chunk); see regions.py. Every element of every tensor
is stored exactly once, by the first holder among identical copies, whatever replication the plan
had, so a save costs no memory beyond the pieces a rank holds. Reading asks for boxes of whole
tensors and copies out of memory-mapped files only the bytes that fall in them, so a load under
any plan or world size (or in one process, or offline by the merge tool) reads only what each
rank keeps, with no knowledge of the saving plan beyond the piece descriptions.

Version 1 directories (whole tensors in torch.save rank files) are still read.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from nnscaler_plugins.checkpoint.atomic import (
    METADATA,
    fsync_file,
    resolve_checkpoint_dir,
)
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.regions import (
    Box,
    Region,
    box_numel,
    box_slices,
    intersect,
)

FORMAT = "nnscaler-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
EXTRA_FILE = "extra.pt"
OBJECTS_FILE = "objects.pt"
ALIGN = 64


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def rng_file(rank: int) -> str:
    """Where a saving rank's random number generator states are (pickled; restored by `load` under
    the same plan and world size)."""
    return f"rng-{rank:05d}.pt"


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


# The optimizer's hyperparameters (tuples, floats, flags) go into a rank file beside the tensors,
# not into the JSON, so they come back with their exact Python types.
OPTIM_GROUPS_KEY = "optim/__param_groups__"


def object_entry(file: str) -> dict[str, Any]:
    return {"object": True, "file": file}


def tensor_entry(t: torch.Tensor, file: str) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "file": file}


def file_digest(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def write_metadata(directory: str, meta: dict[str, Any]) -> None:
    path = os.path.join(directory, METADATA)
    with open(path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    fsync_file(path)


def read_metadata(path: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint directory, its metadata) for a directory or a file inside one."""
    directory = resolve_checkpoint_dir(path)
    if not os.path.exists(directory):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isfile(directory):
        raise CheckpointError(
            f"{path} is a file, not an nnscaler checkpoint directory. An ordinary state dict (from "
            "nns.checkpoint.export or merge) loads with module.load_full_state_dict(torch.load(path)); "
            "nns.checkpoint.load takes the directory nns.checkpoint.save wrote")
    meta_path = os.path.join(directory, METADATA)
    if not os.path.exists(meta_path):
        raise CheckpointError(
            f"{directory} is not a complete nnscaler checkpoint: {METADATA} is missing. A save that did not finish "
            "never appears under the final name, so this directory was made another way or copied partially")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); restore the checkpoint from a copy") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not nnscaler checkpoint metadata (format {meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{meta_path} is corrupt (not a JSON object)")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{directory} has checkpoint format version {meta.get('version')}, this nnscaler-plugins "
                              f"reads versions {list(READABLE_VERSIONS)}; load it with the version that wrote it and "
                              "export it")
    return directory, meta


def verify_files(directory: str, meta: dict[str, Any], hashed: Optional[set[str]] = None) -> None:
    """Every file the metadata names is there and whole (its size), and unchanged (SHA-256): all
    of them, or those in `hashed` (the files a rank reads from: hashing the others would read
    every rank's bytes on every rank)."""
    for name, want in meta["files"].items():
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {directory} is missing {name}; it is incomplete (copied partially?)")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the metadata says {want['bytes']}: "
                                  "it is truncated or was overwritten; restore it from a copy")
        if (hashed is None or name in hashed) and file_digest(path)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt (SHA-256 differs from the metadata); "
                                  "restore it from a copy")


class PieceWriter:
    """One rank's raw file: pieces appended as their bytes (64-byte aligned), hashed while written,
    so the SHA-256 costs no second read."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "wb")
        self._hash = hashlib.sha256()
        self._at = 0

    def add(self, t: torch.Tensor) -> int:
        """Append `t`'s elements (row-major); returns their byte offset."""
        pad = -self._at % ALIGN
        if pad:
            self._write(bytes(pad))
        offset = self._at
        flat = t.detach().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # (a one-element view may keep a stride of its base)
            flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
        if flat.numel():
            self._write(memoryview(flat.view(torch.uint8).numpy()))
        return offset

    def _write(self, data: Any) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._at += len(data)

    def abort(self) -> None:
        """Closed without syncing (the save failed; its directory is removed)."""
        self._f.close()

    def close(self) -> dict[str, Any]:
        """Flushed and synced; the file's size and SHA-256."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"bytes": self._at, "sha256": self._hash.hexdigest()}


def piece_entry(file: str, offset: int, region: Region, lo: int, hi: int) -> dict[str, Any]:
    return {"file": file, "offset": offset, "region": region.to_json(), "lo": lo, "hi": hi}


def stored_tensor_entry(shape: Sequence[int], dtype: torch.dtype, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "pieces": pieces}


def dtype_of(entry: dict[str, Any]) -> torch.dtype:
    return getattr(torch, entry["dtype"])


class TensorReader:
    """Boxes of stored tensors: version 2 pieces copied out of memory-mapped raw files (only the
    pages the box touches are read), version 1 whole tensors out of memory-mapped torch.save files."""

    def __init__(self, directory: str):
        self.directory = directory
        self._open: dict[str, Any] = {}
        self._blocks: dict[int, list] = {}

    def _mapped(self, file: str) -> Any:
        if file not in self._open:
            path = os.path.join(self.directory, file)
            try:
                if file.endswith(".bin"):
                    self._open[file] = np.memmap(path, dtype=np.uint8, mode="c") if os.path.getsize(path) else b""
                else:
                    self._open[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
                raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None
        return self._open[file]

    def get(self, key: str, entry: dict[str, Any]) -> Any:
        """The whole stored tensor (or stored object) of `key`."""
        if entry.get("object"):
            return self._object(key, entry)
        return self.read(key, entry, tuple((0, s) for s in entry["shape"]))

    def _object(self, key: str, entry: dict[str, Any]) -> Any:
        try:
            return self._mapped(entry["file"])[key]
        except KeyError:
            raise CheckpointError(f"checkpoint file {entry['file']} lacks {key!r} that the metadata places there") \
                from None

    def read(self, key: str, entry: dict[str, Any], box: Box) -> torch.Tensor:
        """The elements of `box` of the stored tensor `key` (a new tensor of the box's shape)."""
        if "pieces" not in entry:  # version 1: one whole tensor
            t = self._object(key, entry)
            if list(t.shape) != entry["shape"]:
                raise CheckpointError(f"{key} in {entry['file']} has shape {list(t.shape)}, the metadata says "
                                      f"{entry['shape']}")
            return t[box_slices(box)].clone()
        dtype = dtype_of(entry)
        out = torch.empty(tuple(e - s for s, e in box), dtype=dtype)
        filled = 0
        for file, byte_off, block, pairs in self._stored_blocks(entry):
            for whole_box, piece_box in pairs:
                common = intersect(whole_box, box)
                if common is None:
                    continue
                data = self._block_data(file, byte_off, block, dtype)
                out[box_slices(common, box)] = data[box_slices(piece_box, block)][box_slices(common, whole_box)]
                filled += box_numel(common)
        if filled != box_numel(box):
            raise CheckpointError(f"checkpoint {self.directory}: the pieces stored of {key} cover {filled} of the "
                                  f"{box_numel(box)} elements asked for; the metadata is inconsistent")
        return out

    def files_for(self, entry: dict[str, Any], box: Box) -> set[str]:
        """The files holding some element of `box` of a stored tensor (or object)."""
        if "pieces" not in entry:
            return {entry["file"]}
        return {file for file, _, _, pairs in self._stored_blocks(entry)
                if any(intersect(whole_box, box) is not None for whole_box, _ in pairs)}

    def _stored_blocks(self, entry: dict[str, Any]) -> list:
        cached = self._blocks.get(id(entry))
        if cached is None:
            size = dtype_of(entry).itemsize
            cached = []
            for p in entry["pieces"]:
                region = Region.from_json(p["region"])
                for block, off, pairs in region.blocks(p["lo"], p["hi"]):
                    cached.append((p["file"], p["offset"] + off * size, block, pairs))
            self._blocks[id(entry)] = cached
        return cached

    def _block_data(self, file: str, byte_off: int, block: Box, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(e - s for s, e in block)
        n = math.prod(shape)
        buf = self._mapped(file)
        if byte_off + n * dtype.itemsize > len(buf):
            raise CheckpointError(f"checkpoint file {os.path.join(self.directory, file)} is shorter than its pieces; "
                                  "it is truncated, restore it from a copy")
        return torch.frombuffer(buf, dtype=dtype, count=n, offset=byte_off).view(shape)


def read_extra(directory: str, meta: dict[str, Any]) -> dict[str, Any]:
    if not meta.get("extra_keys") and EXTRA_FILE not in meta["files"]:
        return {}
    path = os.path.join(directory, EXTRA_FILE)
    try:  # extra holds arbitrary picklable objects (RNG states, schedulers): trusted like any pickle
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read {path}: {e}") from None


def model_tensors(directory: str, meta: dict[str, Any],
                  reader: Optional[TensorReader] = None) -> dict[str, torch.Tensor]:
    """The whole model state dict; tied names share one tensor, as in the saved module."""
    reader = reader or TensorReader(directory)
    out: dict[str, torch.Tensor] = {}
    for name, entry in meta["model"].items():
        if "alias_of" not in entry:
            out[name] = reader.get(model_key(name), entry)
    for name, entry in meta["model"].items():
        if "alias_of" in entry:
            out[name] = out[entry["alias_of"]]
    return out


def optimizer_tensors(directory: str, meta: dict[str, Any], reader: Optional[TensorReader] = None) -> Optional[dict]:
    opt = meta.get("optimizer")
    if opt is None:
        return None
    reader = reader or TensorReader(directory)
    state = {name: {key: reader.get(optim_key(name, key), entry) for key, entry in keys.items()}
             for name, keys in opt["state"].items()}
    groups = reader.get(OPTIM_GROUPS_KEY, {"file": opt["param_groups_file"], "object": True})
    return {"state": state, "param_groups": groups}
