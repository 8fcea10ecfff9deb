"""Collectives as autograd functions, each with the backward its dual layout calls for.

Gradients live in the dual layout of their values: a replicated value has the whole gradient on
every replica (not a share of it), a partial-sum value has the whole gradient on every summand, and
a split value has the matching piece. So gathering a split value needs no communication backward
(each device keeps its piece of an already whole gradient), while splitting a replicated value
needs an all-gather backward to make the gradient whole again.

`order` lists the process-group ranks in piece order (piece j lives on group rank order[j]);
resharding needs it because the devices holding consecutive pieces need not be sorted. None means
group-rank order. A `group` of None stands for a device alone (what `ProcessGroups.get` returns
for single-device tuples): the collective is then the identity, or the local piece.

Megatron's sequence parallelism keeps, for the weight gradient of a column-parallel matmul, only
the sequence shard its all-gathered input came from and gathers it again in backward. Here the
same holds for any all-gathered value whose gradient is summed over the group (the input of
column-split pieces): `pack_saved` / `unpack_saved` are the saved-tensor hooks that swap such a
value for its shard and gather it back, exactly (a gather only copies). Whoever installs
saved-tensor hooks around a forward passes what it does not handle itself through them
(`saved_tensor_hooks()` is the pair alone).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from nnscaler_plugins.kernels.reduce_scatter import start as start_reduce_scatter
from nnscaler_plugins.layout import cat_dim, chunk_dim

Order = Optional[Sequence[int]]
# The dtypes a transfer's header can name.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _order(group: Any, order: Order) -> tuple[int, ...]:
    return tuple(range(_size(group))) if order is None else tuple(order)


def _my_index(group: Any, order: tuple[int, ...]) -> int:
    return 0 if group is None else order.index(dist.get_rank(group))


def _gather(x: torch.Tensor, dim: int, group: Any, blocks: int, order: tuple[int, ...]) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in order]
    dist.all_gather(parts, x.contiguous(), group=group)
    return cat_dim([parts[g] for g in order], dim, blocks)


def _scatter_sum(x: torch.Tensor, dim: int, group: Any, blocks: int, order: tuple[int, ...]) -> torch.Tensor:
    n = len(order)
    if group is None:
        return x
    inputs = [chunk_dim(x, dim, n, order.index(g), blocks) for g in range(n)]
    out = torch.empty_like(inputs[0], memory_format=torch.contiguous_format)
    start_reduce_scatter(out, inputs, group).wait()
    return out


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


def _exchange(x: torch.Tensor, src_dim: int, dst_dim: int, group: Any, src_blocks: int, dst_blocks: int,
              order: tuple[int, ...]) -> torch.Tensor:
    n = len(order)
    if group is None:
        return x
    sends = [chunk_dim(x, dst_dim, n, order.index(g), dst_blocks).contiguous() for g in range(n)]
    recvs = [torch.empty_like(s) for s in sends]
    dist.all_to_all(recvs, sends, group=group)
    return cat_dim([recvs[g] for g in order], src_dim, src_blocks)


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks, order):
        ctx.args = (dim, len(order), _my_index(group, order), blocks)
        return _gather(x, dim, group, blocks, order)

    @staticmethod
    def backward(ctx, g):
        dim, n, index, blocks = ctx.args
        return chunk_dim(g, dim, n, index, blocks), None, None, None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks, order):
        ctx.args = (dim, group, blocks, order)
        return _scatter_sum(x, dim, group, blocks, order)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, *ctx.args), None, None, None, None


class _Chunk(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks, order):
        ctx.args = (dim, group, blocks, order)
        return chunk_dim(x, dim, len(order), _my_index(group, order), blocks).clone(
            memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, *ctx.args), None, None, None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group, src_blocks, dst_blocks, order):
        ctx.args = (dst_dim, src_dim, group, dst_blocks, src_blocks, order)
        return _exchange(x, src_dim, dst_dim, group, src_blocks, dst_blocks, order)

    @staticmethod
    def backward(ctx, g):
        return (_exchange(g, *ctx.args),) + (None,) * 6


class _ValueMask(Function):
    @staticmethod
    def forward(ctx, x, keep):
        return x.clone() if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SendRecv(Function):
    @staticmethod
    def forward(ctx, x, send_to, recv_from):
        ctx.peers = (recv_from, send_to)
        return _send_recv(x, send_to, recv_from)

    @staticmethod
    def backward(ctx, g):
        return _send_recv(g, *ctx.peers), None, None


def _send_recv(x: torch.Tensor, send_to: Optional[int], recv_from: Optional[int]) -> torch.Tensor:
    me = dist.get_rank()
    if send_to == me and recv_from == me:
        return x.clone()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops = []
    if send_to is not None:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), send_to))
    if recv_from is not None:
        ops.append(dist.P2POp(dist.irecv, out, recv_from))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out


class _IdentityAllReduce(Function):
    @staticmethod
    def forward(ctx, x, group, piece):
        ctx.group, ctx.piece = group, piece
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.piece is None:
            return _sum(g, ctx.group), None, None
        # `x` was all-gathered over this group, whose backward reads only this device's piece of the
        # gradient: a reduce-scatter gives that piece (Megatron's sequence-parallel backward), half
        # the traffic of an all-reduce; the other pieces stay zero and are never read.
        dim, blocks, order = ctx.piece
        mine = _scatter_sum(g, dim, ctx.group, blocks, order)
        index = _my_index(ctx.group, order)
        pieces = [mine if j == index else torch.zeros_like(mine) for j in range(len(order))]
        return cat_dim(pieces, dim, blocks), None, None


class _GatherScatterSum(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks, order):
        ctx.args = (dim, group, blocks, order)
        return _gather(x, dim, group, blocks, order)

    @staticmethod
    def backward(ctx, g):
        return _scatter_sum(g, *ctx.args), None, None, None, None


# -- public -------------------------------------------------------------------------------------------
def all_gather(x: torch.Tensor, dim: int, group: Any, blocks: int = 1, order: Order = None) -> torch.Tensor:
    """D -> R along `dim`; backward keeps the local piece of the (whole) gradient."""
    out = _AllGather.apply(x, dim, group, blocks, _order(group, order))
    if group is not None and out.requires_grad:
        out._nns_gathered_from = _Regather(x.detach(), dim, group, blocks, _order(group, order),
                                           gathered_version=out._version, shard_version=x._version)
    return out


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """V -> R; backward is the identity (each summand's gradient is the whole gradient)."""
    return _AllReduce.apply(x, group)


def reduce_scatter(x: torch.Tensor, dim: int, group: Any, blocks: int = 1, order: Order = None) -> torch.Tensor:
    """V -> D along `dim`; backward all-gathers the pieces of the gradient."""
    return _ReduceScatter.apply(x, dim, group, blocks, _order(group, order))


def chunk(x: torch.Tensor, dim: int, group: Any, blocks: int = 1, order: Order = None) -> torch.Tensor:
    """R -> D along `dim` without communication; backward all-gathers over `group`."""
    return _Chunk.apply(x, dim, group, blocks, _order(group, order))


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: Any, src_blocks: int = 1,
               dst_blocks: int = 1, order: Order = None) -> torch.Tensor:
    """Move the split from `src_dim` to `dst_dim`; backward moves it back."""
    return _AllToAll.apply(x, src_dim, dst_dim, group, src_blocks, dst_blocks, _order(group, order))


def value_mask(x: torch.Tensor, keep: bool) -> torch.Tensor:
    """R -> V: one summand keeps the value, the others become zeros; backward is the identity."""
    return _ValueMask.apply(x, keep)


def send_recv(x: torch.Tensor, send_to: Optional[int], recv_from: Optional[int]) -> torch.Tensor:
    """One step of a permutation between global ranks (batched isend/irecv); backward runs it reversed.

    The received tensor has the shape and dtype of `x`, since permutations move equal pieces."""
    return _SendRecv.apply(x, send_to, recv_from)


def identity_fwd_allreduce_bwd(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's f: a whole input feeding split pieces, whose gradients are each only a share.

    When `x` was all-gathered, what backward keeps of the result is its shard (see `pack_saved`)."""
    root = x if x._base is None else x._base
    source = getattr(root, "_nns_gathered_from", None)
    if source is not None and not source.unchanged(root):
        source = None  # written in place since the gather (a router's `weights /= sum`): keep it whole
    if source is not None:  # views of the gathered value (a linear saves its input reshaped) find it here
        root._nns_regather = source
    piece = None
    if source is not None and root is x and source.group is group:
        piece = (source.dim, source.blocks, source.order)
    return _IdentityAllReduce.apply(x, group, piece)


def allgather_fwd_reducescatter_bwd(x: torch.Tensor, dim: int, group: Any, blocks: int = 1,
                                    order: Order = None) -> torch.Tensor:
    """A split input made whole for split pieces whose gradients are shares: sum them, keep the piece."""
    return _GatherScatterSum.apply(x, dim, group, blocks, _order(group, order))


def transfer(x: Optional[torch.Tensor], send_to: Sequence[int], recv_from: Optional[int],
             shape: Sequence[int], keep: bool) -> Optional[torch.Tensor]:
    """Whole tensors to devices outside the source set (pipeline stages), by global rank.

    A header carries the dtype and the shape: receivers hold nothing to read them from, and the
    shape follows the batch (`shape`, what lowering saw at the example's sizes, is only its rank).
    This is forward-only: gradients crossing device sets are the pipeline schedule's to send.
    Returns the received tensor, `x` where this device keeps its own copy, else None."""
    # Receivers hold nothing to take a device from; NCCL only moves GPU tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    ndim = len(shape)
    works = []
    for peer in send_to:
        header = torch.tensor([_DTYPES.index(x.dtype), *x.shape], dtype=torch.int64, device=x.device)
        works += [dist.isend(header, peer), dist.isend(x.detach().contiguous(), peer)]
    out = x if keep else None
    if recv_from is not None:
        header = torch.empty(1 + ndim, dtype=torch.int64, device=device)
        dist.recv(header, recv_from)
        values = header.tolist()
        out = torch.empty(tuple(values[1:]), dtype=_DTYPES[int(values[0])], device=device)
        dist.recv(out, recv_from)
    for work in works:
        work.wait()
    return out


# -- saved activations kept as shards -----------------------------------------------------------------
@dataclass(eq=False)
class _Regather:
    """A saved all-gathered value, held as this device's shard; gathered again at its first use in
    backward and kept until every node that saved it has taken it (the q, k and v projections of
    one gathered input share one gather, as Megatron's fused QKV matmul does)."""

    shard: torch.Tensor
    dim: int
    group: Any
    blocks: int
    order: tuple[int, ...]
    users: int = 0
    whole: Optional[torch.Tensor] = field(default=None, repr=False)
    # Versions at the gather: a gather repeated in backward equals the saved value only while
    # neither the gathered tensor nor the shard has been written in place since.
    gathered_version: int = 0
    shard_version: int = 0

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def unchanged(self, gathered: torch.Tensor) -> bool:
        return gathered._version == self.gathered_version and self.shard._version == self.shard_version

    def take(self) -> torch.Tensor:
        if self.shard._version != self.shard_version:
            raise RuntimeError("a tensor saved for backward was modified by an in-place operation after it was "
                               "all-gathered (its local shard changed), so backward cannot gather it again")
        whole = self.whole if self.whole is not None else _gather(self.shard, self.dim, self.group, self.blocks,
                                                                  self.order)
        self.users -= 1
        self.whole = whole if self.users > 0 else None
        return whole


@dataclass(frozen=True)
class _SavedView:
    """A saved tensor that is (a view of) a regathered value."""

    source: _Regather
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    gathered: Any = None  # weak reference to the gathered tensor, to see in-place writes after the save


def pack_saved(t: torch.Tensor) -> Any:
    """Saved-tensor pack hook: the all-gathered input of column-split pieces becomes its shard."""
    root = t if t._base is None else t._base
    source = getattr(root, "_nns_regather", None)
    if source is None or root.storage_offset() != 0 or not root.is_contiguous() or not source.unchanged(root):
        return t
    source.users += 1
    return _SavedView(source, tuple(t.size()), tuple(t.stride()), t.storage_offset(), weakref.ref(root))


def unpack_saved(saved: Any) -> torch.Tensor:
    """Saved-tensor unpack hook matching `pack_saved` (collectives in backward run in the same order on
    every device of the group: each device's autograd graph is the same)."""
    if not isinstance(saved, _SavedView):
        return saved
    gathered = saved.gathered() if saved.gathered is not None else None
    if gathered is not None and gathered._version != saved.source.gathered_version:
        raise RuntimeError("a tensor saved for backward (an all-gathered input) was modified by an in-place "
                           "operation after it was saved")
    return saved.source.take().as_strided(saved.size, saved.stride, saved.offset)


def saved_bytes(packed: Any) -> int:
    """Bytes `pack_saved`'s answer holds for backward, asked right after packing (a shard shared by
    several nodes counts once)."""
    if isinstance(packed, _SavedView):
        return packed.source.nbytes if packed.source.users == 1 else 0
    return packed.numel() * packed.element_size() if isinstance(packed, torch.Tensor) else 0


@contextlib.contextmanager
def saved_tensor_hooks(on_save: Optional[Callable[[Any], None]] = None) -> Iterator[None]:
    """A forward whose saved all-gathered inputs are kept as shards; `on_save` sees what is kept of
    each saved tensor (a measurement: saved-tensor hooks do not nest)."""
    def pack(t: torch.Tensor) -> Any:
        packed = pack_saved(t)
        if on_save is not None:
            on_save(packed)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved):
        yield
