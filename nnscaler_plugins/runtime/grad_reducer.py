"""Gradient reducers: sum (and average across data-parallel replicas) the gradients of parameters
that several devices hold whole, like DDP: bucketed, launched asynchronously from the autograd
hooks as soon as a bucket's gradients are ready, so communication overlaps the rest of backward.
The first bucket is small (1 MiB, as DDP's) where collectives run on a stream of their own (CUDA,
NCCL); on gloo every bucket is 25 MiB, since there the collectives take the cores the backward runs
on and a small early one only adds a collective's fixed cost.

With ZeRO stage 2 (`shards=`), a bucket is reduce-scattered instead: each data-parallel replica
receives only its chunk of every gradient in the bucket (see runtime/zero.py for the layout),
kept in `shard_grads`, and the whole gradient is dropped. A gradient summed over more devices than
the replicas (the two copies of a tied embedding on the first and last pipeline stage) cannot be
reduce-scattered with the rest: it is all-reduced, then only its chunk is kept (`chunk_after=`).

The chunks are read only by the optimizer `nns.build_optimizer` makes; a plain torch optimizer over
the module's parameters reads `.grad`, which stage 2 leaves empty, and would skip those
parameters. So a bucket is reduce-scattered only while `scatter()` says such an optimizer exists;
otherwise it is all-reduced whole into `.grad`, as at stage 1, and any optimizer steps exactly.

With `overlap=False` (a plan's `overlap_grad_reduce=False`, see search/overlap.py) no bucket starts
during backward: all of them are reduced, in the same order, when it ends.

With `in_order=True` (the eager executor, which runs the user's own forward) a bucket starts only once
every bucket before it has, as DDP's do: generated code makes the gradients ready in the same order on
every rank, but the user's code may take another branch on another rank (a data-dependent head, an
unused layer), and collectives started in different orders would pair different buckets.

A flag the ranks must agree on at the end of the backward (the non-finite guard's loss flag) can ride
on the reduction (`carry`): one more element at the end of the first bucket's buffer, summed with it,
instead of a collective of its own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.kernels import reduce_scatter
from nnscaler_plugins.runtime.flight_recorder import OUTSIDE
from nnscaler_plugins.runtime.zero import FlatShard, reduce_scatter_layout


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: object
    scale: float
    ready: set[int] = field(default_factory=set)
    work: Optional[object] = None
    buffer: Optional[torch.Tensor] = None
    shards: Optional[list[FlatShard]] = None  # ZeRO-2: reduce-scatter, keep the owned chunks
    # The flat buffer an all-reduce of this bucket uses, kept from step to step as DDP keeps its
    # buckets: made anew at every step it would be a large allocation whose pages the OS hands back
    # and faults in again (the C heap returns a freed top region), a few milliseconds a step on a CPU.
    # It holds a step's gradients only while they are reduced, so the peak is what it was.
    flat: Optional[torch.Tensor] = None
    rider: bool = False  # this reduction's buffer ends with the carried flag (`GradReducer.carry`)


class GradReducer:
    """One reducer per ParallelModule. `entries` are (parameter, process group, scale)."""

    def __init__(self, entries: list[tuple[torch.nn.Parameter, object, float]], bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: Optional[int] = None, shards: Optional[dict[int, FlatShard]] = None,
                 chunk_after: Optional[dict[int, FlatShard]] = None, scatter: Callable[[], bool] = lambda: True,
                 overlap: bool = True, in_order: bool = False):
        self.buckets: list[_Bucket] = []
        self.overlap = overlap  # False: every bucket starts when the backward ends
        self.in_order = in_order  # True: bucket i starts only after buckets 0..i-1 (see the module doc)
        self._next_launch = 0  # in_order: the first bucket not started in this reduction
        self._where: dict[int, tuple[int, int]] = {}
        self._sync = True
        self._queued = False
        # a backward under no_sync accumulated gradients since the last reduction: they differ per rank
        self.local_since_reduce = False
        self.launched = 0  # bucket reductions started so far (tests read it to see no_sync work)
        self._shards = shards or {}
        self._chunk_after = chunk_after or {}
        self._scatter = scatter  # ZeRO-2: keep chunks (True) or whole gradients in .grad (False), per reduction
        self._whole = False  # this reduction keeps whole gradients (decided when its first bucket launches)
        # ZeRO-2: id(parameter) -> its reduced chunk (summed over the backward passes since zero_grad).
        self.shard_grads: dict[int, torch.Tensor] = {}
        self._rider: Optional[torch.Tensor] = None  # the flag the next reduction carries (`carry`)
        # Where a wait for a bucket is told (runtime/flight_recorder.py), and each parameter's name by
        # id: a hang inside a bucket's reduction is named by the bucket and the parameters it holds.
        self.recorder: Optional[Any] = None
        self.names: dict[int, str] = {}
        self._carried: Optional[torch.Tensor] = None  # its sum over the ranks, once that reduction ended
        # Reverse order approximates the order gradients become ready in backward.
        by_group: dict[tuple[int, float], list[torch.nn.Parameter]] = {}
        groups: dict[tuple[int, float], object] = {}
        for p, g, s in reversed(entries):
            k = (id(g), s, p.dtype, p.device, id(p) in self._shards)
            by_group.setdefault(k, []).append(p)
            groups[k] = g
        for k, ps in by_group.items():
            # The first bucket is small, as in DDP, where collectives have an engine of their own (NCCL's
            # stream): the gradients ready first start communicating while the rest of backward still
            # runs instead of waiting for 25 MB of them. On gloo a collective takes the cores the backward
            # computes on, so an early small bucket hides nothing and costs one collective's fixed time
            # more (2 % of a GPT-2-shaped step on 4 CPU processes): its buckets are all of one size.
            first = first_bucket_bytes
            if first is None:
                first = 2**20 if ps[0].device.type == "cuda" else bucket_bytes
            cur: list[torch.nn.Parameter] = []
            size, cap = 0, first
            for p in ps:
                cur.append(p)
                size += p.numel() * p.element_size()
                if size >= cap:
                    self._add(cur, groups[k], k[1])
                    cur, size, cap = [], 0, bucket_bytes
            if cur:
                self._add(cur, groups[k], k[1])
        for p, _g, _s in entries:
            p.register_post_accumulate_grad_hook(self._hook)

    def _add(self, params: list[torch.nn.Parameter], group: object, scale: float) -> None:
        b = len(self.buckets)
        for i, p in enumerate(params):
            self._where[id(p)] = (b, i)
        shards = [self._shards[id(p)] for p in params] if id(params[0]) in self._shards else None
        self.buckets.append(_Bucket(params, group, scale, shards=shards))

    def carry(self, flag: torch.Tensor) -> None:
        """Have the next reduction sum the one-element `flag` over the ranks as one more element of its
        first bucket (collective: every rank calls it before the same backward). `carried()` gives the sum
        once that reduction ended, scaled as that bucket's gradients (> 0 when any rank's flag was).
        The first bucket is the same on every rank, so every rank's buffer has the same size; it is
        always reduced (`_finish` launches an unused bucket too)."""
        self._rider, self._carried = flag, None

    def carried(self) -> Optional[torch.Tensor]:
        """The flag `carry` gave the last reduction, summed over the ranks; None when no reduction
        carried it (no synchronized backward ran, or the first bucket is reduce-scattered or spans fewer
        ranks than the world: the caller agrees on it by itself). Forgotten once read."""
        out, self._carried = self._carried, None
        return out

    def _rides(self, bucket: _Bucket) -> bool:
        return (self._rider is not None and bucket is self.buckets[0] and bucket.params[0].is_floating_point()
                and dist.get_world_size(bucket.group) == dist.get_world_size())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the context reduces the sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def reduce_now(self) -> None:
        """Reduce every bucket at once (after a pipeline step, whose micro-batches accumulate
        gradients under no_sync)."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        self._finish()

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            self.local_since_reduce = True
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        bucket.ready.add(i)
        if not self.overlap:
            return
        if not self.in_order:
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket)
            return
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if not any(b.work is not None for b in self.buckets) and (self._shards or self._chunk_after):
            self._whole = not self._scatter()  # one decision per reduction, the same on every rank
        if bucket.shards is not None and not self._whole:
            send = reduce_scatter_layout(bucket.shards, grads, bucket.scale)
            bucket.buffer = send.new_empty(sum(s.chunk for s in bucket.shards))
            bucket.work = reduce_scatter.start(bucket.buffer, send, bucket.group)
            for p in bucket.params:  # the whole gradient is not kept: only the chunk this replica owns
                p.grad = None
            self.launched += 1
            return
        n = sum(g.numel() for g in grads)
        bucket.rider = self._rides(bucket)
        size = n + 1 if bucket.rider else n
        flat = bucket.flat
        if flat is None or flat.numel() != size or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = bucket.flat = grads[0].new_empty(size)
        offsets = _offsets(grads)
        views = [_is_view_at(g, flat, off) for g, off in zip(grads, offsets)]
        if not any(views):
            torch.cat([g.reshape(-1) for g in grads], out=flat[:n])
        else:  # gradients accumulated into the bucket's own views (zero_grad without set_to_none, no_sync)
            for g, off, there in zip(grads, offsets, views):
                if not there:
                    flat[off:off + g.numel()].copy_(g.reshape(-1))
        if bucket.rider:
            flat[n:].copy_(self._rider.reshape(1))
            self._rider = None
        bucket.buffer = flat
        if bucket.scale != 1.0:  # averaging before the sum, as DDP does: one op per bucket
            bucket.buffer.mul_(bucket.scale)
        bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
        self.launched += 1

    def describe(self, i: int) -> tuple[str, str]:
        """Bucket `i`'s reduction in words, and the parameters whose gradients it holds (the op a
        hang report names)."""
        b = self.buckets[i]
        how = "reduce-scatter" if b.shards is not None and not self._whole else "all-reduce"
        names = [self.names.get(id(p), f"parameter of shape {list(p.shape)}") for p in b.params]
        held = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        return (f"{how} of gradient bucket {i + 1} of {len(self.buckets)} ({len(names)} parameters)",
                f"the gradients of {held}")

    def _finish(self) -> None:
        self._next_launch = 0
        for bucket in self.buckets:
            if bucket.work is None:  # parameters unused in this backward: reduce their (zero) grads
                self._launch(bucket)
        for i, bucket in enumerate(self.buckets):
            if self.recorder is not None:
                self.recorder.enter(OUTSIDE, self.describe(i))
            bucket.work.wait()
            if self.recorder is not None:
                self.recorder.leave()
            off = 0
            if bucket.shards is not None and not self._whole:
                for p, s in zip(bucket.params, bucket.shards):
                    mine = bucket.buffer[off:off + s.hi - s.lo]
                    have = self.shard_grads.get(id(p))
                    self.shard_grads[id(p)] = mine.clone() if have is None else have.add_(mine)
                    off += s.chunk
            if bucket.rider:
                self._carried = bucket.buffer[-1:].float().clone()  # the buffer is the next reduction's too
                bucket.rider = False
            for p in (bucket.params if bucket.shards is None or self._whole else ()):
                n = p.numel()
                g = bucket.buffer[off:off + n].view_as(p)
                fs = None if self._whole else self._chunk_after.get(id(p))
                if fs is not None:  # ZeRO-2 of a gradient all-reduced whole: keep our chunk only
                    mine = fs.owned(g.reshape(-1))
                    have = self.shard_grads.get(id(p))
                    self.shard_grads[id(p)] = mine.clone() if have is None else have.add_(mine)
                    p.grad = None
                else:
                    # the gradient stays in the bucket, as DDP's gradient_as_bucket_view: no copy back, and
                    # one copy of the gradients held between steps instead of two; the next reduction
                    # overwrites it, so whoever reads `.grad` reads it before the next backward
                    p.grad = g
                off += n
            bucket.work = None
            bucket.buffer = None
            bucket.ready.clear()
        self._queued = False
        self.local_since_reduce = False
        self._rider = None  # a flag no bucket could carry: `carried()` says None


def _offsets(grads: list[torch.Tensor]) -> list[int]:
    out, off = [], 0
    for g in grads:
        out.append(off)
        off += g.numel()
    return out


def _is_view_at(g: torch.Tensor, flat: torch.Tensor, off: int) -> bool:
    """Whether `g` is already the bucket's view at `off` (a gradient accumulated in place there)."""
    return (g.is_contiguous() and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and g.storage_offset() == flat.storage_offset() + off)
