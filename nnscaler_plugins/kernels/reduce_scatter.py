"""Reduce-scatter that moves each byte once, on every backend.

A reduce-scatter of n pieces leaves on each rank the sum of its own piece over the group. A ring
does it with every rank sending and receiving (n-1)/n of the input, the same traffic as an
all-gather of the result, and that is what the cost model prices (`search/network.py`).

Gloo has no such collective: torch's gloo backend runs `reduce_scatter_tensor` and the list
`reduce_scatter` as a whole all-reduce followed by keeping this rank's piece, twice the traffic.
Measured on a 2-core host with 4 gloo processes, 16 MiB of fp32: `reduce_scatter_tensor` 30 ms,
`all_reduce` 28 ms, and `all_to_all_single` plus a local sum of the n pieces that arrive 16 ms.
So on gloo each piece goes straight to its owner with one `all_to_all_single`, and the owner sums
the n pieces it receives (every piece's sum is formed in one place, in rank order, so the result is
the same on every run). Every other backend (NCCL, ...) runs its own reduce-scatter.

`start` returns a handle with `wait()`; the result is in `out` once `wait()` returns, as with a
`torch.distributed` work object, which is what the handle is on other backends.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collective; older releases only have the old name.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Pieces = Union[torch.Tensor, Sequence[torch.Tensor]]


class _SummedOnArrival:
    """An all-to-all in flight whose n received pieces are summed into `out` at `wait()`."""

    __slots__ = ("work", "send", "recv", "out", "n", "done")

    def __init__(self, work: Any, send: torch.Tensor, recv: torch.Tensor, out: torch.Tensor, n: int):
        # `send` is held too: the caller may drop its pieces as soon as the collective is started.
        self.work, self.send, self.recv, self.out, self.n, self.done = work, send, recv, out, n, False

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            torch.sum(self.recv.view(self.n, -1), 0, out=self.out.view(-1))
            self.work = self.send = self.recv = None
            self.done = True
        return True


class _Done:
    """The handle of a reduce-scatter over one rank (a copy)."""

    def wait(self) -> bool:
        return True


def backend_for(backend: str, device_type: str) -> str:
    """The backend that runs a group's collectives on tensors of `device_type`: a group made for
    several device types names one backend each ("cpu:gloo,cuda:nccl")."""
    if ":" not in backend:
        return backend
    return dict(part.split(":", 1) for part in backend.split(",")).get(device_type, backend)


def has_own_reduce_scatter(group: Any, device: torch.device = torch.device("cpu")) -> bool:
    """Whether the backend that runs `group`'s collectives on `device` has a reduce-scatter of its
    own: False for gloo (see the module)."""
    return backend_for(dist.get_backend(group), device.type) != "gloo"


def start(out: torch.Tensor, pieces: Pieces, group: Any) -> Any:
    """Start summing `pieces` over `group` into `out`, this rank's piece of the sum.

    `pieces` is either one flat tensor of n * out.numel() elements (piece j at [j*m, (j+1)*m)) or n
    tensors of out's size, piece j for group rank j. `out` must be contiguous.

    On gloo the n pieces arrive in a buffer of the input's size that lives until `wait()` returns.
    It comes from the heap, not from ZeRO-3's pool of mapped host buffers: the pool keeps what it
    lends resident for reuse, where a heap buffer's pages serve the next activation gradient."""
    n = dist.get_world_size(group)
    flat = isinstance(pieces, torch.Tensor)
    if not flat and len(pieces) != n:
        raise ValueError(f"reduce-scatter over {n} ranks was given {len(pieces)} pieces")
    if n == 1:
        out.copy_(pieces.view_as(out) if flat else pieces[0])
        return _Done()
    if has_own_reduce_scatter(group, out.device):
        if flat:
            return _reduce_scatter_flat(out, pieces, group=group, async_op=True)
        return dist.reduce_scatter(out, [p.contiguous() for p in pieces], group=group, async_op=True)
    if flat:
        send = pieces.reshape(-1)
    else:  # one copy of each piece, strided or not, into the buffer the all-to-all sends
        m = out.numel()
        send = out.new_empty(n * m)
        for j, p in enumerate(pieces):
            send[j * m:(j + 1) * m].view(p.shape).copy_(p)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return _SummedOnArrival(work, send, recv, out, n)

