"""A source of pretrained or saved weights: whole tensors by name, read one box at a time.

`load` checks names, shapes and dtypes against the module once, whatever the source (our
directories, Hugging Face `save_pretrained` directories, DCP directories), and then asks each
source only for the boxes of the pieces this rank holds.
"""
from __future__ import annotations

from typing import Callable

import torch

from nnscaler_plugins.checkpoint.regions import Box


class WeightSource:
    """Whole tensors by name, read box by box. `tensors` maps every name (tied names included) to
    (whole shape, dtype); `read(name, box)` returns those elements only."""

    kind = "checkpoint"

    def __init__(self, where: str, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 read: Callable[[str, Box], torch.Tensor], origin: str = ""):
        self.where, self.tensors, self.read, self.origin = where, tensors, read, origin
