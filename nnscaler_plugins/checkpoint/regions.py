"""Which elements of a whole tensor a device's piece holds, as boxes that can be read or written alone.

A device's piece under a layout holds, along every dim, an ordered list of ranges of the whole
tensor (one range per block of a blocked split): a `Region`. ZeRO cuts the piece's flattened
elements once more, keeping `[lo, hi)`. Both are expressed here as *boxes*: a box is a range per
dim of the whole tensor. A flat range of a row-major array is a short list of boxes each of which
is contiguous in memory (at most two per dim), and each box of the piece maps onto a few boxes of
the whole tensor (split where a blocked dim jumps). So every piece a rank writes or needs is a
handful of (whole-tensor box, place in the piece) pairs: saving writes the piece's bytes as they
are, loading asks a source for exactly the boxes it needs, whatever plan wrote them.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from nnscaler_plugins.layout import Layout, block_slices

Range = tuple[int, int]
Box = tuple[Range, ...]


def box_numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


def box_slices(box: Box, origin: Optional[Box] = None) -> tuple[slice, ...]:
    """Slices selecting `box` inside an array that starts at `origin` (the whole tensor by default)."""
    if origin is None:
        return tuple(slice(s, e) for s, e in box)
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = []
    for (s1, e1), (s2, e2) in zip(a, b):
        s, e = max(s1, s2), min(e1, e2)
        if s >= e:
            return None
        out.append((s, e))
    return tuple(out)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[Box, int]]:
    """Elements `[lo, hi)` of a row-major array of `shape` as boxes, each contiguous in memory,
    with the flat offset where each starts; in memory order."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), 0)]
    inner = math.prod(shape[1:])
    full = tuple((0, s) for s in shape[1:])
    a, ra = divmod(lo, inner)
    b, rb = divmod(hi, inner)
    if a == b:
        return [(((a, a + 1),) + sub, a * inner + off) for sub, off in flat_boxes(shape[1:], ra, rb)]
    out = []
    if ra:
        out += [(((a, a + 1),) + sub, a * inner + off) for sub, off in flat_boxes(shape[1:], ra, inner)]
        a += 1
    if b > a:
        out.append((((a, b),) + full, a * inner))
    if rb:
        out += [(((b, b + 1),) + sub, b * inner + off) for sub, off in flat_boxes(shape[1:], 0, rb)]
    return out


@dataclass(frozen=True)
class Region:
    """Per dim, the ranges of the whole tensor a piece holds, in the piece's order."""

    dims: tuple[tuple[Range, ...], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Region":
        return cls(tuple(((0, int(s)),) for s in shape))

    @classmethod
    def of_layout(cls, lay: Layout, device: int) -> "Region":
        """The piece `device` holds under `lay` (its value chunk aside)."""
        _, _, digits = lay.digits(lay.position_of(device))
        dims = []
        for size, n, j, b in zip(lay.shape, lay.splits, digits, lay.blocks):
            count = abs(b)  # negative: mirrored blocks (layout.block_slices says which slice each takes)
            block, width = size // count, size // (count * n)
            dims.append(tuple((k * block + i * width, k * block + (i + 1) * width)
                              for k, i in enumerate(block_slices(b, n, j))))
        return cls(_merged(dims))

    @classmethod
    def from_json(cls, data: Sequence[Sequence[Sequence[int]]]) -> "Region":
        return cls(tuple(tuple((int(s), int(e)) for s, e in d) for d in data))

    def to_json(self) -> list[list[list[int]]]:
        return [[[s, e] for s, e in d] for d in self.dims]

    @property
    def shape(self) -> tuple[int, ...]:
        """The piece's own (local) shape."""
        return tuple(sum(e - s for s, e in d) for d in self.dims)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_whole(self, local: Box) -> list[tuple[Box, Box]]:
        """A box of the piece as (whole-tensor box, the same elements as a box of the piece) pairs."""
        per_dim = []
        for (ls, le), ranges in zip(local, self.dims):
            parts, at = [], 0
            for gs, ge in ranges:
                s, e = max(ls, at), min(le, at + ge - gs)
                if s < e:
                    parts.append(((gs + s - at, gs + e - at), (s, e)))
                at += ge - gs
            per_dim.append(parts)
        return [(tuple(g for g, _ in combo), tuple(loc for _, loc in combo)) for combo in itertools.product(*per_dim)]

    def blocks(self, lo: int = 0, hi: Optional[int] = None) -> list[tuple[Box, int, list[tuple[Box, Box]]]]:
        """Elements `[lo, hi)` of the flattened piece as (box of the piece, its flat offset from lo,
        its (whole box, piece box) pairs): what a writer stores and a reader maps back."""
        hi = self.numel if hi is None else hi
        return [(box, off - lo, self.to_whole(box)) for box, off in flat_boxes(self.shape, lo, hi)]


def _merged(dims: list[tuple[Range, ...]]) -> tuple[tuple[Range, ...], ...]:
    """Adjacent ranges joined (a split into one piece of b blocks is one range)."""
    out = []
    for ranges in dims:
        joined: list[Range] = []
        for s, e in ranges:
            if joined and joined[-1][1] == s:
                joined[-1] = (joined[-1][0], e)
            else:
                joined.append((s, e))
        out.append(tuple(joined))
    return tuple(out)


# Reads one box of a whole tensor (as a tensor of the box's shape).
ReadBox = Callable[[Box], torch.Tensor]


def read_piece(region: Region, read: ReadBox, dtype: Optional[torch.dtype], lo: int = 0,
               hi: Optional[int] = None) -> torch.Tensor:
    """Flat elements `[lo, hi)` of the piece `region`, filled box by box from `read`: only the
    whole tensor's elements the piece holds are ever asked for. `dtype` None keeps the stored one."""
    hi = region.numel if hi is None else hi
    out: Optional[torch.Tensor] = None
    for box, off, pairs in region.blocks(lo, hi):
        n = box_numel(box)
        for whole_box, piece_box in pairs:
            data = read(whole_box)
            if out is None:
                out = torch.empty(max(hi - lo, 0), dtype=dtype or data.dtype)
            out[off:off + n].view(tuple(e - s for s, e in box))[box_slices(piece_box, box)] = data.to(out.dtype)
    return out if out is not None else torch.empty(0, dtype=dtype or torch.float32)
