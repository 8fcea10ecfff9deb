"""Running a co-sharded region: a device's pieces one after another, each recomputed in backward.

Generated code calls these for the ops a plan co-shards (several consecutive pieces of one split on
one device). Each piece runs under a non-reentrant checkpoint, so what a piece computes inside the
region is dropped after its forward and recomputed during backward: only one piece's intermediates
are alive at a time, which is where the memory goes down, while the communication around the region
is the same as for the plain split.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.utils.checkpoint as ckpt

from nnscaler_plugins.layout import cat_dim, chunk_dim
from nnscaler_plugins.kernels.collectives import pack_saved, saved_bytes, unpack_saved

_meters: list["SavedBytes"] = []


def chunk(x: torch.Tensor, dims: Sequence[int], chunks: int, index: int, blocks: int = 1) -> torch.Tensor:
    """Piece `index` of `chunks` of the device's local tensor along the co-sharded dims."""
    for d in dims:
        x = chunk_dim(x, d, chunks, index, blocks)
    return x


def first(x: torch.Tensor, index: int) -> torch.Tensor:
    """An input added once (a bias under a split reduction): piece 0 gets it, the others zeros."""
    return x if index == 0 else torch.zeros_like(x)


def cat(pieces: Sequence[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    return cat_dim(list(pieces), dim, blocks)


def total(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    out = pieces[0]
    for p in pieces[1:]:
        out = out + p
    return out


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """One piece, recomputed in backward when gradients are being recorded."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    for meter in _meters:
        meter.add_inputs(args)
    return ckpt.checkpoint(fn, *args, use_reentrant=False)


class SavedBytes:
    """Bytes kept for backward while the block runs: what autograd saves, plus the inputs co-sharded
    pieces keep for their recomputation. The peak activation memory of a step, measured."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def _count(self, t: torch.Tensor) -> None:
        key = id(t)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += t.numel() * t.element_size()

    def add_inputs(self, args: Sequence[Any]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._count(a)

    def count_packed(self, packed: Any) -> None:
        """Count what a saved-tensor pack hook kept (a tensor, or the shard of a gathered one); for
        forwards that install their own hooks (`active_meter`)."""
        if isinstance(packed, torch.Tensor):
            self._count(packed)
        else:  # a shard shared by several nodes counts once (`saved_bytes`)
            self.bytes += saved_bytes(packed)

    @contextlib.contextmanager
    def __call__(self) -> Iterator["SavedBytes"]:
        def pack(t: torch.Tensor) -> Any:
            packed = pack_saved(t)
            self.count_packed(packed)
            return packed

        _meters.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved):
                yield self
        finally:
            _meters.remove(self)


def active_meter() -> Optional[SavedBytes]:
    """The innermost `SavedBytes` measuring now, for a forward that installs saved-tensor hooks of its
    own (they replace the meter's) to report to."""
    return _meters[-1] if _meters else None


def measure_forward(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn` (a forward) and return its result with the bytes kept for its backward."""
    meter = SavedBytes()
    with meter():
        out = fn()
    return out, meter.bytes
