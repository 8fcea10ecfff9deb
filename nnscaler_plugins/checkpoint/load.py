"""`load`: checks the checkpoint against the module (and optimizer) first, then each rank reads
only the elements of the pieces it holds under the module's current plan.

The same reading serves every source of weights: a directory `save` wrote, a Hugging Face
`save_pretrained` directory (hf_weights.py) and a torch.distributed.checkpoint directory (dcp.py).
Each is a `WeightSource`: names with whole shapes and dtypes, and a box reader.
"""
from __future__ import annotations

import json
import os
import pickle
import warnings
from typing import Any, Callable

import torch

from nnscaler_plugins.checkpoint.background import wait_for_saves
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.format import (
    OPTIM_GROUPS_KEY,
    TensorReader,
    dtype_of,
    model_key,
    optim_key,
    read_extra,
    read_metadata,
    rng_file,
    verify_files,
)
from nnscaler_plugins.checkpoint.model_state import expected_model_tensors
from nnscaler_plugins.checkpoint.optimizer_state import (
    check_optimizer_matches,
    optimizer_algorithm,
    read_optimizer_state,
)
from nnscaler_plugins.checkpoint.pieces import (
    aliases,
    model_slots,
    optimizer_slots,
)
from nnscaler_plugins.checkpoint.regions import Box, read_piece
from nnscaler_plugins.checkpoint.sources import WeightSource


def checkpoint_source(directory: str, meta: dict[str, Any], reader: TensorReader) -> WeightSource:
    model = meta["model"]
    tensors = {}
    for name, entry in model.items():
        src = model[entry["alias_of"]] if "alias_of" in entry else entry
        tensors[name] = (tuple(src["shape"]), dtype_of(src) if "dtype" in src else torch.float32)

    def read(name: str, box: Box) -> torch.Tensor:
        entry = model[name]
        stored = entry.get("alias_of", name)
        return reader.read(model_key(stored), model[stored], box)

    saved = meta.get("plan", {})
    origin = f"saved from {saved.get('model_class') or 'another model'}, strategy {saved.get('strategy')!r}"
    return WeightSource(directory, tensors, read, origin)


def _names_of(module: torch.nn.Module) -> dict[str, list[str]]:
    """Every state name of the module -> its tied names (itself first)."""
    tied = aliases(module)
    groups: dict[str, list[str]] = {}
    for alias, name in tied.items():
        groups.setdefault(name, [name]).append(alias)
    return {n: g for g in groups.values() for n in g}


def model_mismatch(source: WeightSource, module: torch.nn.Module, strict: bool = True) -> list[str]:
    """Missing, unexpected and differently shaped tensors between a source and a module. A name the
    source lacks is found under a name tied to it (a tied output embedding saved once)."""
    want = expected_model_tensors(module)
    tied = _names_of(module)
    have = {n: shape for n, (shape, _) in source.tensors.items()}
    found = {n: next((t for t in tied.get(n, [n]) if t in have), None) for n in want}
    problems = []
    missing = [n for n, f in found.items() if f is None]
    used = set(found.values())
    unexpected = [n for n in have if n not in want and n not in used]
    shapes = [n for n, f in found.items() if f is not None and tuple(want[n]) != tuple(have[f])]
    if missing:
        problems.append(f"missing from the {source.kind} ({len(missing)}): " +
                        ", ".join(f"{n} {list(want[n])}" for n in missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if unexpected and strict:
        problems.append(f"in the {source.kind} but not in the module ({len(unexpected)}): " +
                        ", ".join(f"{n} {list(have[n])}" for n in unexpected[:20]) +
                        (" ..." if len(unexpected) > 20 else ""))
    for n in shapes[:20]:
        problems.append(f"{n}: the {source.kind} has shape {list(have[found[n]])}, the module {list(want[n])}")
    return problems


def load_model_pieces(module: torch.nn.Module, source: WeightSource) -> list[str]:
    """Each held piece of the module's state read from `source` (only its elements); returns the
    dtype conversions made, in words."""
    tied = _names_of(module)
    conversions: dict[tuple[str, str], int] = {}
    local_of = _local_tensors(module)
    with torch.no_grad():
        for slot in model_slots(module):
            local = local_of(slot)
            if slot.zeroed:
                local.zero_()
                continue
            name = next((t for t in tied.get(slot.name, [slot.name]) if t in source.tensors), None)
            if name is None:
                continue  # strict=False and not in the source (checked before)
            stored = source.tensors[name][1]
            if stored != local.dtype:
                pair = (str(stored).removeprefix("torch."), str(local.dtype).removeprefix("torch."))
                conversions[pair] = conversions.get(pair, 0) + 1
            p = slot.piece
            flat = read_piece(p.region, lambda box, n=name: source.read(n, box), local.dtype, p.lo, p.hi)
            local.copy_(flat.view(local.shape))
    return [f"{n} tensor(s) from {a} to {b}" for (a, b), n in sorted(conversions.items())]


def _local_tensors(module: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    if getattr(module, "program", None) is not None and hasattr(module, "local_tensor"):
        return lambda slot: module.local_tensor(slot.key)
    state = module.state_dict(keep_vars=True)
    return lambda slot: state[slot.name]


def _read_optimizer(module: Any, optimizer: Any, meta: dict[str, Any], reader: TensorReader) -> None:
    """This rank's pieces of the saved optimizer state into `optimizer`."""
    entries = {optim_key(fqn, key): e for fqn, keys in meta["optimizer"]["state"].items() for key, e in keys.items()}
    saved = {fqn: {key: None if e.get("object") else tuple(e["shape"]) for key, e in keys.items()}
             for fqn, keys in meta["optimizer"]["state"].items()}
    groups = reader.get(OPTIM_GROUPS_KEY, {"file": meta["optimizer"]["param_groups_file"], "object": True})
    read_optimizer_state(module, optimizer, saved, lambda name, box: reader.read(name, entries[name], box),
                         lambda name: reader.get(name, entries[name]), groups, optim_key)


def saved_by_another_kind(meta: dict[str, Any], module: Any, optimizer: Any,
                          allow_precision_change: bool = False) -> list[str]:
    """What a checkpoint was saved by that differs from what would load it, as problems to refuse
    before anything changes: another optimizer class (its state has other entries: SGD's into AdamW
    would step on a missing `exp_avg`), another precision (the weights would be converted, the
    fp16 loss scaler's state dropped). The model itself is compared by names and shapes
    (`model_mismatch`)."""
    problems = []
    saved_algo = meta.get("optimizer_algorithm")
    if optimizer is not None and saved_algo is not None and meta.get("optimizer") is not None:
        mine = optimizer_algorithm(optimizer)
        if mine != saved_algo:
            problems.append(f"the checkpoint's optimizer state is {saved_algo.rsplit('.', 1)[-1]}'s ({saved_algo}), this "
                            f"optimizer is {mine.rsplit('.', 1)[-1]} ({mine}); load it into a {saved_algo} optimizer, "
                            "or load the weights alone (optimizer=None) and start the new optimizer afresh")
    saved_precision = (meta.get("plan") or {}).get("precision")
    plan = getattr(module, "plan", None)
    mine_precision = getattr(plan, "precision", None)
    if (saved_precision is not None and mine_precision is not None and saved_precision != mine_precision
            and not allow_precision_change):
        problems.append(f"the checkpoint was saved under precision {saved_precision!r}, this module's plan has "
                        f"{mine_precision!r}; make the plan with precision={saved_precision!r} to resume, or pass "
                        "allow_precision_change=True to load the weights converted")
    return problems


def load(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *, strict: bool = True,
         rng: bool = True, allow_precision_change: bool = False) -> dict[str, Any]:
    """Load a checkpoint into `module` (and `optimizer`), under whatever plan and world size they
    have now; returns the `extra` values given to save. Call on every rank.

    `path` is a directory `nns.checkpoint.save` wrote, a Hugging Face `save_pretrained`
    directory (model.safetensors, sharded with model.safetensors.index.json, or pytorch_model.bin;
    weights only) or a torch.distributed.checkpoint directory (weights, and optimizer state in
    the layout `export_dcp` writes). Each rank reads only the elements of the pieces it holds.
    Nothing is changed unless the source fits: names and shapes are compared first and every
    mismatch is listed; damaged files are detected by size and SHA-256 before reading.
    `strict=False` ignores tensors the module does not have. `rng`: restore each rank's random
    number generators as they were at the save, when the checkpoint was saved by the same plan on
    the same world size (so a resumed job draws the same dropout masks as one never stopped).
    A checkpoint saved with another optimizer class, or under another precision, is refused
    before anything changes; `allow_precision_change=True` loads one of another precision, its
    weights converted (said in a warning).
    """
    wait_for_saves()  # a background save in flight ends first (it may be the one asked for)
    from nnscaler_plugins.checkpoint.dcp import is_dcp_dir
    from nnscaler_plugins.checkpoint.hf_weights import hf_source, is_hf_dir, matched_to

    where = os.fspath(path)
    if is_hf_dir(where) or is_dcp_dir(where):
        from nnscaler_plugins.checkpoint.dcp import dcp_source
        if optimizer is not None and is_hf_dir(where):
            raise CheckpointError(f"{where} is a Hugging Face save_pretrained directory: it holds weights only; load "
                                  "it without optimizer=")
        source = hf_source(where) if is_hf_dir(where) else dcp_source(where)
        if is_hf_dir(where):
            source = matched_to(source, set(expected_model_tensors(module)))
        _check(source, module, strict, [])
        notes = load_model_pieces(module, source)
        if optimizer is not None:
            from nnscaler_plugins.checkpoint.dcp import load_dcp_optimizer
            load_dcp_optimizer(where, module, optimizer)
        _state_conversions(notes, source)
        return {}
    directory, meta = read_metadata(where)
    reader = TensorReader(directory)
    source = checkpoint_source(directory, meta, reader)
    problems = []
    if optimizer is not None:
        if meta.get("optimizer") is None:
            problems.append("the checkpoint holds no optimizer state (it was saved without optimizer=); "
                            "load it without optimizer= or save one that has it")
        else:
            problems += check_optimizer_matches(module, optimizer, [{"params": g} for g in meta["optimizer"]["groups"]])
    problems += saved_by_another_kind(meta, module, optimizer, allow_precision_change)
    _check(source, module, strict, problems)
    verify_files(directory, meta, _files_read(module, optimizer, meta, reader))
    extra = read_extra(directory, meta)
    notes = load_model_pieces(module, source)
    if allow_precision_change:
        _state_conversions(notes, source)
    if optimizer is not None:
        _read_optimizer(module, optimizer, meta, reader)
    if rng:
        restore_rng(directory, meta, module)
    return extra


def restore_rng(directory: str, meta: dict[str, Any], module: Any) -> bool:
    """This rank's random number generator states from the checkpoint, when it was saved by the
    same plan on the same world size (each rank then plays the role it had); whether it did."""
    from nnscaler_plugins.checkpoint.agreement import world
    from nnscaler_plugins.checkpoint.save import plan_summary

    rank, size = world()
    name = rng_file(rank)
    if meta.get("world_size") != size or name not in meta["files"]:
        return False
    if json.loads(json.dumps(plan_summary(module))) != meta.get("plan"):
        return False
    with open(os.path.join(directory, name), "rb") as f:
        state = pickle.load(f)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "pieces" in state and hasattr(module, "set_random_stream"):
        module.set_random_stream(state["pieces"])
    return True


def _files_read(module: Any, optimizer: Any, meta: dict[str, Any], reader: TensorReader) -> set[str]:
    """The files this rank reads from: the pieces' files that overlap its own pieces, and the small
    files every rank reads."""
    files = {name for name in meta["files"] if not name.endswith(".bin")}

    def add(entry: dict, shape: tuple[int, ...], region: Any, lo: int, hi: int) -> None:
        if entry.get("object"):
            return
        if tuple(entry["shape"]) != tuple(shape) or not shape:  # read whole (a step count)
            files.update(reader.files_for(entry, tuple((0, n) for n in entry["shape"])))
            return
        for _, _, pairs in region.blocks(lo, hi):
            for whole_box, _ in pairs:
                files.update(reader.files_for(entry, whole_box))

    model, tied = meta["model"], _names_of(module)
    for slot in model_slots(module):
        name = next((t for t in tied.get(slot.name, [slot.name]) if t in model), None)
        if name is not None and not slot.zeroed:
            p = slot.piece
            add(model[model[name].get("alias_of", name)], p.shape, p.region, p.lo, p.hi)
    if optimizer is not None and meta.get("optimizer") is not None:
        saved = meta["optimizer"]["state"]
        for slot in optimizer_slots(module, optimizer):
            for entry in saved.get(slot.fqn, {}).values():
                add(entry, slot.shape, slot.region, slot.lo, slot.hi)
    return files


def _check(source: WeightSource, module: torch.nn.Module, strict: bool, problems: list[str]) -> None:
    problems = model_mismatch(source, module, strict) + problems
    if problems:
        origin = f" ({source.origin})" if source.origin else ""
        raise CheckpointError(f"{source.kind} {source.where}{origin} does not fit this module; nothing was loaded:\n  "
                              + "\n  ".join(problems))


def _state_conversions(notes: list[str], source: WeightSource) -> None:
    """Dtype conversions are said once (rank 0), not done silently."""
    from nnscaler_plugins.checkpoint.agreement import world

    if notes and world()[0] == 0:
        warnings.warn(f"nns.checkpoint.load: converted {', '.join(notes)} while reading {source.where}", stacklevel=3)
