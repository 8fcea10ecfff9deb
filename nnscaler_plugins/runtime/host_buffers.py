"""Transient host buffers: whole parameters gathered for a forward, which live around one use.

ZeRO-3 on the CPU gathers a few such buffers per layer in every forward. From the C heap, buffers
freed between the pieces that stay (activations saved for backward, chunks, optimizer state) are
kept by the process for reuse (glibc keeps freed regions below 32 MiB) but reused only in part by
the allocations that follow, and what a rank holds grows to the worst interleaving of a step's
buffers instead of the most it uses at once. (The backward is the other way round: it frees
activations and their gradients as it goes, so its gathered weights and gradient buffers come from
the heap, whose pages they share with those; see `Zero3Params._gather_buffer`.) Mapped from the OS at every use instead, each buffer's pages
are faulted in and zeroed by the kernel again (about 0.4 ms a MiB, five times a warm copy), a
cost FSDP2's caching of the same buffers does not pay.

So a large buffer is mapped from the OS and, once no tensor uses it any more, kept for the next
request of the same size (the same layer shapes repeat every step), within a bound on what the
pool keeps, lent or idle: buffers up to `POOL_BUFFER_BYTES` each and `POOL_BYTES` in all, so a
rank holds at most that much more than it uses at once. Other buffers (beyond the bound, or as
large as a vocabulary embedding's gathered weight) are unmapped when their last view goes. A mapping is idle
when the pool holds the only reference to it: a tensor made with `torch.frombuffer` keeps one on
the mapping for as long as any view of its storage is alive.

An idle mapping still holds its pages. At the end of a forward, when the activations a backward
needs are all alive, ZeRO-3's idle buffers are the weights of layers the forward is done with:
`release_idle` hands their pages back to the OS and keeps the mappings, so they hold no pages
through the backward, and the next forward faults in only the pages it touches again.
"""
from __future__ import annotations

import mmap
import sys

import torch

MAPPED_BYTES = 2**20  # transient host buffers from this size on are mapped from the OS
POOL_BUFFER_BYTES = 16 * 2**20  # the largest mapping kept for reuse once idle
POOL_BYTES = 16 * 2**20  # mappings kept in all (lent or idle), per process


class MappedPool:
    """Mappings lent out as tensors and taken back, for reuse, when no tensor uses them."""

    def __init__(self, buffer_bytes: int = POOL_BUFFER_BYTES, total_bytes: int = POOL_BYTES):
        self.buffer_bytes = buffer_bytes
        self.total_bytes = total_bytes
        self._held: dict[int, list[mmap.mmap]] = {}  # size -> mappings, lent or idle
        self.mapped = 0  # mappings made (a test reads it: reuse makes none in a steady step)

    @staticmethod
    def _idle(held: list[mmap.mmap], i: int) -> bool:
        """Whether `held[i]` is referenced by the list alone (the second reference counted is
        getrefcount's own argument): no tensor uses it."""
        return sys.getrefcount(held[i]) == 2

    def take(self, nbytes: int) -> mmap.mmap:
        """A mapping of `nbytes`: an idle one of that size, else a new one (kept for reuse when small
        enough and the pool has room)."""
        held = self._held.get(nbytes, [])
        for i in range(len(held)):
            if self._idle(held, i):
                return held[i]
        mm = mmap.mmap(-1, nbytes)
        self.mapped += 1
        # kept while the pool has room (the first buffers of a step, the same every step: no churn);
        # else used once and unmapped when its tensor goes
        if nbytes <= self.buffer_bytes and sum(self.kept()) + nbytes <= self.total_bytes:
            self._held.setdefault(nbytes, []).append(mm)
        return mm

    def kept(self) -> list[int]:
        """The sizes of the mappings kept for reuse, lent or idle, smallest first."""
        return sorted(size for size, held in self._held.items() for _ in held)

    def idle_bytes(self) -> int:
        """Bytes of the mappings kept that no tensor uses now."""
        return sum(size for size, held in self._held.items() for i in range(len(held)) if self._idle(held, i))

    def release_idle(self) -> int:
        """Hand the pages of every idle mapping back to the OS, keeping the mappings (the next use
        faults in fresh zero pages); returns the bytes released. Where the OS has no such advice,
        nothing happens."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None:
            return 0
        released = 0
        for size, held in self._held.items():
            for i in range(len(held)):
                if self._idle(held, i):
                    held[i].madvise(advice)
                    released += size
        return released

    def clear(self) -> None:
        """Let go of every idle mapping (those in use are unmapped when their tensors go)."""
        for size, held in self._held.items():
            self._held[size] = [held[i] for i in range(len(held)) if not self._idle(held, i)]


POOL = MappedPool()


def transient_empty(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat uninitialized buffer of `like`'s dtype and device that lives only around one use (a
    gathered whole parameter, a gradient bucket being reduced); in host memory a large one comes
    from `POOL` (see the module docstring)."""
    nbytes = numel * like.element_size()
    if like.device.type != "cpu" or nbytes < MAPPED_BYTES:
        return like.new_empty(numel)
    return torch.frombuffer(POOL.take(nbytes), dtype=like.dtype, count=numel)
