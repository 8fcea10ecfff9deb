"""RVD layouts: how one logical tensor is spread over an ordered group of devices.

A layout is R identical copies of V partial-sum chunks, each chunk cut into D pieces per dimension.
Position p in `group` is read as mixed-radix digits (r, v, d0, ..., d_{n-1}), r most significant, so
the lowering can compute where every piece of every operator lives from digits alone.

Blocked (strided) splits exist for fused projections: with `blocks` b on a dimension, the dimension
is seen as b equal blocks and piece j takes the j-th slice of every block, so that a fused QKV output
split per head still separates into q, k and v on every device.

A negative block count -b is a *mirrored* blocked split: b blocks, piece j takes the j-th slice of
the even blocks and the (num-1-j)-th slice of the odd ones. With b = 2 on a sequence dim this is
the causal load balancing of context parallelism: device j of cp holds chunks j and 2cp-1-j of the
2cp chunks, so every device sees the same amount of unmasked causal attention. Every piece still
has the same shape and cat/chunk stay exact inverses, so resharding needs nothing else: it passes
the block count to `chunk_dim` and `cat_dim`, which read the sign.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import torch


def block_slices(blocks: int, num: int, index: int) -> list[int]:
    """Which slice (of `num` per block) piece `index` takes in each block; see the module doc."""
    count, mirrored = abs(blocks), blocks < 0
    return [num - 1 - index if mirrored and k % 2 else index for k in range(count)]


def chunk_dim(t: torch.Tensor, dim: int, num: int, index: int, blocks: int = 1) -> torch.Tensor:
    """Piece `index` of `num` along `dim` of a blocked split (a view, not a copy, unless mirrored)."""
    size = t.shape[dim]
    count = abs(blocks)
    if blocks == 0 or size % (count * num):
        raise ValueError(f"dim {dim} of size {size} cannot be cut into {num} pieces of {blocks} blocks")
    width = size // (count * num)
    if blocks == 1:
        return t.narrow(dim, index * width, width)
    if blocks > 1:
        return t.unflatten(dim, (count, size // count)).narrow(dim + 1, index * width, width).flatten(dim, dim + 1)
    if num == 1:
        return t
    per = size // count
    return torch.cat([t.narrow(dim, k * per + j * width, width)
                      for k, j in enumerate(block_slices(blocks, num, index))], dim)


def cat_dim(pieces: Sequence[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """Inverse of `chunk_dim`: pieces in index order back into one tensor."""
    if len(pieces) == 1:
        return pieces[0]
    if blocks == 1:
        return torch.cat(list(pieces), dim)
    if blocks > 1:
        views = [p.unflatten(dim, (blocks, p.shape[dim] // blocks)) for p in pieces]
        return torch.cat(views, dim + 1).flatten(dim, dim + 1)
    count, num = -blocks, len(pieces)
    slices = [p.chunk(count, dim) for p in pieces]  # slices[i][k]: piece i's slice in block k
    out = []
    for k in range(count):
        by_slot = {block_slices(blocks, num, i)[k]: slices[i][k] for i in range(num)}
        out.extend(by_slot[j] for j in range(num))
    return torch.cat(out, dim)


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    group: tuple[int, ...]
    replicas: int = 1
    partial: int = 1
    splits: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Normalized so that equal layouts compare (and hash, for plan caches) equal however written.
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "group", tuple(int(g) for g in self.group))
        object.__setattr__(self, "splits", tuple(int(s) for s in self.splits) or (1,) * len(shape))
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks) or (1,) * len(shape))
        self._check()

    def _check(self) -> None:
        problem = None
        if len(self.splits) != len(self.shape) or len(self.blocks) != len(self.shape):
            problem = f"splits and blocks need one entry per dim of shape {self.shape}"
        elif min((self.replicas, self.partial) + self.splits, default=1) < 1 or 0 in self.blocks:
            problem = "replicas, partial and splits must be positive, blocks nonzero (negative: mirrored)"
        elif self.replicas * self.partial * math.prod(self.splits) != len(self.group):
            problem = f"replicas * partial * prod(splits) must equal the {len(self.group)} devices"
        elif len(set(self.group)) != len(self.group):
            problem = "a device appears twice in the group"
        else:
            for d, (s, n, b) in enumerate(zip(self.shape, self.splits, self.blocks)):
                if s % (n * abs(b)):
                    problem = f"dim {d} of size {s} is not divisible by splits {n} x blocks {b}"
        if problem:
            raise ValueError(f"layout {self}: {problem}")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def replicated(cls, shape: Sequence[int], group: Sequence[int]) -> "Layout":
        return cls(tuple(shape), tuple(group), replicas=len(group))

    @classmethod
    def sharded(cls, shape: Sequence[int], group: Sequence[int], dim: int, num: Optional[int] = None,
                blocks: int = 1) -> "Layout":
        """Split along `dim` into `num` pieces (all devices by default), replicated over the rest."""
        num = len(group) if num is None else num
        if len(group) % num:
            raise ValueError(f"{len(group)} devices cannot hold {num} pieces equally")
        dim = dim % len(shape)
        splits = tuple(num if d == dim else 1 for d in range(len(shape)))
        bl = tuple(blocks if d == dim else 1 for d in range(len(shape)))
        return cls(tuple(shape), tuple(group), replicas=len(group) // num, splits=splits, blocks=bl)

    def with_group(self, group: Sequence[int]) -> "Layout":
        return replace(self, group=tuple(group))

    def dual(self) -> "Layout":
        """Where the gradient lives: partial sums' gradients are whole on every summand."""
        return replace(self, replicas=self.replicas * self.partial, partial=1)

    # -- positions --------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return len(self.group)

    @property
    def radices(self) -> tuple[int, ...]:
        return (self.replicas, self.partial) + self.splits

    def digits(self, pos: int) -> tuple[int, int, tuple[int, ...]]:
        out = []
        for radix in reversed(self.radices):
            out.append(pos % radix)
            pos //= radix
        out.reverse()
        return out[0], out[1], tuple(out[2:])

    def position(self, r: int, v: int, d: Sequence[int]) -> int:
        pos = 0
        for digit, radix in zip((r, v, *d), self.radices):
            pos = pos * radix + digit
        return pos

    def position_of(self, rank: int) -> int:
        try:
            return self.group.index(rank)
        except ValueError:
            raise ValueError(f"device {rank} holds no piece of {self}") from None

    def local_shape(self) -> tuple[int, ...]:
        return tuple(s // n for s, n in zip(self.shape, self.splits))

    # -- data -------------------------------------------------------------------------------------
    def slice_full(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This device's piece of a whole tensor; value chunk 0 carries it all, the others zeros."""
        if tuple(full.shape) != self.shape:
            raise ValueError(f"tensor of shape {tuple(full.shape)} given for {self}")
        _, v, d = self.digits(self.position_of(rank))
        t = full
        for dim, (n, j, b) in enumerate(zip(self.splits, d, self.blocks)):
            if n > 1:
                t = chunk_dim(t, dim, n, j, b)
        return t if v == 0 else torch.zeros_like(t)

    def assemble(self, pieces: Mapping[int, torch.Tensor], check_replicas: bool = False,
                 atol: float = 1e-6) -> torch.Tensor:
        """The whole tensor from every device's piece (sum of value chunks, splits put back)."""
        by_digits = {}
        for pos, rank in enumerate(self.group):
            r, v, d = self.digits(pos)
            if r == 0:
                by_digits[(v, d)] = pieces[rank]
            elif check_replicas:
                first = pieces[self.group[self.position(0, v, d)]]
                if not torch.allclose(pieces[rank], first, atol=atol):
                    raise ValueError(f"replica {r} on device {rank} differs from replica 0 in {self}")
        total = None
        for v in range(self.partial):
            whole = self._cat({d: t for (vv, d), t in by_digits.items() if vv == v}, 0, ())
            total = whole if total is None else total + whole
        return total

    def _cat(self, chunks: dict[tuple[int, ...], torch.Tensor], dim: int, prefix: tuple[int, ...]) -> torch.Tensor:
        if dim == self.ndim:
            return chunks[prefix]
        parts = [self._cat(chunks, dim + 1, prefix + (j,)) for j in range(self.splits[dim])]
        return cat_dim(parts, dim, self.blocks[dim])

    # -- text -------------------------------------------------------------------------------------
    def __str__(self) -> str:
        text = f"R{self.replicas} V{self.partial} D({','.join(map(str, self.splits))})"
        if any(b != 1 for b in self.blocks):
            text += f" B({','.join(map(str, self.blocks))})"
        return f"{text} on [{','.join(map(str, self.group))}]"

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "group": list(self.group), "replicas": self.replicas,
                "partial": self.partial, "splits": list(self.splits), "blocks": list(self.blocks)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Layout":
        return cls(tuple(data["shape"]), tuple(data["group"]), int(data.get("replicas", 1)),
                   int(data.get("partial", 1)), tuple(data.get("splits", ())), tuple(data.get("blocks", ())))
