"""The on-disk layout of a checkpoint directory, and reading it back with clear errors.

    CKPT/metadata.json       format and version, the saving plan (strategy, fingerprint, world
                             size), every tensor's name, shape, dtype and file, the files' sizes
                             and SHA-256, the optimizer's groups and extra's keys
    CKPT/rank-00000.pt ...   one torch.save file per saving rank: the whole tensors it owns
    CKPT/extra.pt            the caller's extra values (pickled)

Tensors are stored whole, under the model's own names, rather than as each rank's local shards
with slice metadata: loading under any plan or world size (or in one process, or offline by the
merge tool) then needs no knowledge of the saving plan, and every tensor is written exactly once
whatever replication the plan had. The price is paid at save time: whole tensors are gathered
(through the module's own `full_state_dict`) before they are written.

Keys inside the files are "model/NAME" and "optim/NAME/KEY"; the optimizer's parameter groups and
any non-tensor state sit in rank 0's file as plain Python values (still `weights_only`-safe).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import torch

from nnscaler_plugins.checkpoint.atomic import (
    METADATA,
    fsync_file,
    resolve_checkpoint_dir,
)
from nnscaler_plugins.checkpoint.errors import CheckpointError

FORMAT = "nnscaler-checkpoint"
VERSION = 1
EXTRA_FILE = "extra.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


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
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{directory} has checkpoint format version {meta.get('version')}, this nnscaler-plugins "
                              f"reads version {VERSION}; load it with the version that wrote it and export it")
    return directory, meta


def verify_files(directory: str, meta: dict[str, Any]) -> None:
    """Every file the metadata names is there, whole and unchanged (size and SHA-256)."""
    for name, want in meta["files"].items():
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {directory} is missing {name}; it is incomplete (copied partially?)")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the metadata says {want['bytes']}: "
                                  "it is truncated or was overwritten; restore it from a copy")
        if file_digest(path)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt (SHA-256 differs from the metadata); "
                                  "restore it from a copy")


class TensorReader:
    """Tensors by key from the rank files, each file opened once (memory-mapped)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, key: str, entry: dict[str, Any]) -> torch.Tensor:
        file = entry["file"]
        if file not in self._open:
            path = os.path.join(self.directory, file)
            try:
                self._open[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
                raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None
        try:
            t = self._open[file][key]
        except KeyError:
            raise CheckpointError(f"checkpoint file {file} lacks {key!r} that the metadata places there") from None
        if entry.get("object"):
            return t
        if list(t.shape) != entry["shape"]:
            raise CheckpointError(f"{key} in {file} has shape {list(t.shape)}, the metadata says {entry['shape']}")
        return t


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
