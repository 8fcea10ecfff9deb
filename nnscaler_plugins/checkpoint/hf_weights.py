"""Pretrained weights from a Hugging Face `save_pretrained` directory, read per shard.

safetensors files are read with `safe_open(...).get_slice(name)[box]`, which reads only the bytes
of the requested rows and columns, so a rank of a tensor-parallel or ZeRO-3 plan reads the
elements of its own pieces and never a whole weight it does not hold. One `model.safetensors`,
several with `model.safetensors.index.json`, and `pytorch_model.bin` (sharded with its index;
memory-mapped, so a box touches only its pages) are understood.

Names are the model's own: a model whose checkpoint was saved from its base model (`h.0...` for
`transformer.h.0...`) is matched the way `from_pretrained` does, by the one prefix that makes the
names agree; a tied weight saved once (the output embedding) is read under the name it was saved.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.regions import Box, box_slices
from nnscaler_plugins.checkpoint.sources import WeightSource

SAFE_ONE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_ONE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_FILES = (SAFE_INDEX, SAFE_ONE, BIN_INDEX, BIN_ONE)

_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def is_hf_dir(path: str) -> bool:
    """A directory `save_pretrained` wrote (and not an nnscaler checkpoint)."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, "metadata.json")) and \
        any(os.path.exists(os.path.join(path, f)) for f in _FILES)


def _weight_map(directory: str, index: str) -> dict[str, str]:
    path = os.path.join(directory, index)
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is not a readable index of shards ({e}); save the model again") from None
    missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(directory, f))})
    if missing:
        raise CheckpointError(f"{directory}: the index names shard file(s) {missing[:4]} that are not there; the "
                              "download or copy is incomplete")
    return weight_map


def hf_source(directory: str) -> Any:
    """The directory's tensors as a `WeightSource` (names, whole shapes and dtypes, box reads)."""
    if os.path.exists(os.path.join(directory, SAFE_INDEX)):
        files = _weight_map(directory, SAFE_INDEX)
    elif os.path.exists(os.path.join(directory, SAFE_ONE)):
        files = None
    else:
        return _bin_source(directory)
    from safetensors import safe_open

    handles: dict[str, Any] = {}

    def handle(file: str) -> Any:
        if file not in handles:
            try:
                handles[file] = safe_open(os.path.join(directory, file), framework="pt")
            except Exception as e:  # noqa: BLE001 - a damaged or foreign file
                raise CheckpointError(f"cannot read {os.path.join(directory, file)}: {e}") from None
        return handles[file]

    if files is None:
        files = {name: SAFE_ONE for name in handle(SAFE_ONE).keys()}
    tensors = {}
    for name, file in files.items():
        sl = handle(file).get_slice(name)
        dtype = _SAFE_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise CheckpointError(f"{name} in {file} has dtype {sl.get_dtype()}, which this reader does not know")
        tensors[name] = (tuple(sl.get_shape()), dtype)

    def read(name: str, box: Box) -> torch.Tensor:
        f = handle(files[name])
        if not box:
            return f.get_tensor(name)
        return f.get_slice(name)[box_slices(box)]

    source = WeightSource(directory, tensors, read, "a Hugging Face save_pretrained directory")
    source.kind = "pretrained checkpoint"
    return source


def _bin_source(directory: str) -> Any:
    files = _weight_map(directory, BIN_INDEX) if os.path.exists(os.path.join(directory, BIN_INDEX)) else None
    opened: dict[str, dict[str, torch.Tensor]] = {}

    def state(file: str) -> dict[str, torch.Tensor]:
        if file not in opened:
            path = os.path.join(directory, file)
            try:
                opened[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"cannot read {path}: {e}") from None
        return opened[file]

    if files is None:
        files = {name: BIN_ONE for name in state(BIN_ONE)}
    tensors = {n: (tuple(state(f)[n].shape), state(f)[n].dtype) for n, f in files.items()}
    def read(name: str, box: Box) -> torch.Tensor:
        return state(files[name])[name][box_slices(box)].clone()

    source = WeightSource(directory, tensors, read, "a Hugging Face save_pretrained directory")
    source.kind = "pretrained checkpoint"
    return source


def matched_to(source: Any, wanted: set[str]) -> Any:
    """`source` with its names moved by the one prefix (added or removed) under which most of them
    are the module's, as `from_pretrained` matches a base model's checkpoint to a model with a head;
    unchanged when the names already agree best."""
    have = set(source.tensors)
    best, best_hits = None, len(have & wanted)
    prefixes = {n.split(".", 1)[0] for n in wanted | have if "." in n}
    for p in sorted(prefixes):
        added = sum(1 for n in have if f"{p}.{n}" in wanted)
        removed = sum(1 for n in have if n.startswith(p + ".") and n[len(p) + 1:] in wanted)
        for hits, how in ((added, ("add", p)), (removed, ("strip", p))):
            if hits > best_hits:
                best, best_hits = how, hits
    if best is None:
        return source
    how, p = best
    if how == "add":
        rename = {f"{p}.{n}": n for n in have}
    else:
        rename = {(n[len(p) + 1:] if n.startswith(p + ".") else n): n for n in have}
    moved = WeightSource(source.where, {new: source.tensors[old] for new, old in rename.items()},
                         lambda name, box: source.read(rename[name], box),
                         f"{source.origin}, names {'prefixed with' if how == 'add' else 'without'} {p!r}")
    moved.kind = source.kind
    return moved
