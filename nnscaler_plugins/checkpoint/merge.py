"""`merge`: a sharded checkpoint into one file, offline: no processes, no model, no plan."""
from __future__ import annotations

import os
from typing import Any

from nnscaler_plugins.checkpoint.export import write_state_dict_file
from nnscaler_plugins.checkpoint.format import (
    TensorReader,
    model_tensors,
    optimizer_tensors,
    read_extra,
    read_metadata,
    verify_files,
)


def merge(checkpoint: str | os.PathLike, out: str | os.PathLike, *, with_optimizer: bool = False) -> str:
    """Write the checkpoint's model as one ordinary state dict at `out` (what
    `model.load_state_dict` takes). With `with_optimizer`, `out` holds {"model": state dict,
    "optimizer": {"state": {param name: {key: tensor}}, "param_groups": [...]}, "extra": {...}}."""
    directory, meta = read_metadata(os.fspath(checkpoint))
    verify_files(directory, meta)
    reader = TensorReader(directory)
    state: Any = model_tensors(directory, meta, reader)
    if with_optimizer:
        state = {"model": state, "optimizer": optimizer_tensors(directory, meta, reader),
                 "extra": read_extra(directory, meta)}
    final = os.path.abspath(os.fspath(out))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    write_state_dict_file(state, final)
    return final
