"""`load`: checks the checkpoint against the module (and optimizer) first, then each rank reads
the whole tensors and keeps its own pieces under the module's current plan."""
from __future__ import annotations

import os
from typing import Any

import torch

from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.format import (
    TensorReader,
    model_tensors,
    optimizer_tensors,
    read_extra,
    read_metadata,
    verify_files,
)
from nnscaler_plugins.checkpoint.model_state import (
    expected_model_tensors,
    load_model_state,
)
from nnscaler_plugins.checkpoint.optimizer_state import (
    check_optimizer_matches,
    load_optimizer_state,
)


def model_mismatch(meta: dict[str, Any], module: torch.nn.Module, strict: bool = True) -> list[str]:
    """Missing, unexpected and differently shaped tensors between a checkpoint and a module."""
    want = expected_model_tensors(module)
    have: dict[str, tuple[int, ...]] = {}
    for name, entry in meta["model"].items():
        src = meta["model"][entry["alias_of"]] if "alias_of" in entry else entry
        have[name] = tuple(src["shape"])
    problems = []
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want]
    shapes = [n for n in want if n in have and want[n] != have[n]]
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): " +
                        ", ".join(f"{n} {list(want[n])}" for n in missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if unexpected and strict:
        problems.append(f"in the checkpoint but not in the module ({len(unexpected)}): " +
                        ", ".join(f"{n} {list(have[n])}" for n in unexpected[:20]) +
                        (" ..." if len(unexpected) > 20 else ""))
    for n in shapes[:20]:
        problems.append(f"{n}: checkpoint has shape {list(have[n])}, the module {list(want[n])}")
    return problems


def load(path: str | os.PathLike, module: torch.nn.Module, optimizer: Any = None, *, strict: bool = True
         ) -> dict[str, Any]:
    """Load a checkpoint written by `save` into `module` (and `optimizer`), under whatever plan and
    world size they have now; returns the `extra` values given to save. Call on every rank.

    Nothing is changed unless the checkpoint fits: names and shapes are compared first and every
    mismatch is listed; damaged files are detected by size and SHA-256 before reading.
    `strict=False` ignores tensors the module does not have.
    """
    directory, meta = read_metadata(os.fspath(path))
    problems = model_mismatch(meta, module, strict)
    if optimizer is not None:
        if meta.get("optimizer") is None:
            problems.append("the checkpoint holds no optimizer state (it was saved without optimizer=); "
                            "load it without optimizer= or save one that has it")
        else:
            problems += check_optimizer_matches(module, optimizer, [{"params": g} for g in meta["optimizer"]["groups"]])
    if problems:
        saved = meta.get("plan", {})
        origin = saved.get("model_class") or "another model"
        raise CheckpointError(f"checkpoint {directory} (saved from {origin}, strategy {saved.get('strategy')!r}) does "
                              f"not fit this module; nothing was loaded:\n  " + "\n  ".join(problems))
    verify_files(directory, meta)
    reader = TensorReader(directory)
    state = model_tensors(directory, meta, reader)
    if not strict:
        want = expected_model_tensors(module)
        state = {k: v for k, v in state.items() if k in want}
    optim = optimizer_tensors(directory, meta, reader) if optimizer is not None else None
    extra = read_extra(directory, meta)
    load_model_state(module, state)
    if optimizer is not None:
        load_optimizer_state(module, optimizer, optim)
    return extra
