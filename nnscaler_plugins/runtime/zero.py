"""ZeRO: how each parameter's training state is cut across the data-parallel replicas.

Every trainable parameter shard a device holds (its tensor-parallel piece, or the whole weight) is
flattened and cut into `size` equal chunks, one per data-parallel replica of that device (the
last chunks may be short or empty); replica `index` owns chunk `index`. Cutting each parameter on
its own (rather than one flat buffer across parameters) keeps the optimizer's state per parameter,
so state dicts, learning-rate groups and checkpoints keep parameter names, while communication is
still bucketed: the chunks of all parameters in one group travel in one collective, laid out
replica-major so that the gathered buffer is every parameter's flat tensor back to back.

Stage 1 keeps whole gradients (all-reduced as in DDP) and steps only the owned chunk; stage 2
reduce-scatters gradients so each replica keeps its chunk only (GradReducer in "shard" mode); at
both, the updated chunks are all-gathered back into the parameters after the step, in buckets
left in flight (`PendingGather`) that the next forward waits for one at a time, right before it
first reads one of their parameters (Megatron's overlap-param-gather);
stage 3 also stores only the owned chunk of each parameter: `Zero3Params` gathers each whole
parameter just before the forward's first use of it (prefetching the next) and lets it go after
the last, lets saved-tensor hooks drop them from what autograd keeps for backward (they are gathered again when backward needs them, the next one prefetched while the
current node computes; the layer the forward gathered last stays gathered for the backward, which
starts on it), and reduce-scatters their gradients
asynchronously from the backward, overlapped with the rest of it (a weight read twice, summed first). Under precision="fp8" the weights
of float8 linears are gathered as float8 (`Zero3Params.gather_in_float8`, torchao's FSDP float8
all-gather): each replica casts its chunk with the whole weight's tensorwise scale (one all-reduce
of the chunks' maxima per forward, for all of them), so the gathered values are those of casting
the whole weight, and their gradients are reduce-scattered in the chunks' dtype as any other.
"""
from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.kernels.collectives import pack_saved, unpack_saved
from nnscaler_plugins.kernels import reduce_scatter
from nnscaler_plugins.kernels.float8 import is_float8
from nnscaler_plugins.runtime.flight_recorder import OUTSIDE
from nnscaler_plugins.runtime.host_buffers import POOL, transient_empty

# torch 2.13 renamed the flat-tensor collective; older releases only have the old name.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
BUCKET_BYTES = 25 * 2**20
MAX_IN_FLIGHT = 2  # gradient reductions started and not yet waited for (see Zero3Params.flush)


@dataclass
class FlatShard:
    """This rank's chunk of one parameter's flattened elements, across `size` replicas."""

    fqn: str
    shape: tuple[int, ...]  # the device's (tensor-parallel) shard of the parameter
    group: Any  # process group of the data-parallel replicas (None when size == 1)
    size: int
    index: int
    # Process group the gradient is summed over when it is larger than the replicas (a weight a
    # tensor-parallel unit keeps whole on several devices and sums their gradients of); else None.
    sum_group: Any = None
    count_in_norm: bool = True  # False on all but one holder of identical copies

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk(self) -> int:
        return -(-self.numel // self.size) if self.numel else 0

    @property
    def lo(self) -> int:
        return min(self.index * self.chunk, self.numel)

    @property
    def hi(self) -> int:
        return min(self.lo + self.chunk, self.numel)

    def owned(self, flat: torch.Tensor) -> torch.Tensor:
        """The owned chunk of a flat tensor of the whole shard (a view)."""
        return flat[self.lo:self.hi]

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """The flat tensor padded to size * chunk elements, shaped (size, chunk)."""
        flat = t.reshape(-1)
        pad = self.size * self.chunk - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.size, self.chunk)

    def chunk_padded(self, c: torch.Tensor) -> torch.Tensor:
        """An owned chunk padded to `chunk` elements."""
        pad = self.chunk - c.numel()
        return torch.cat([c.reshape(-1), c.new_zeros(pad)]) if pad else c.reshape(-1)


def _buckets(shards: list[FlatShard]) -> list[tuple[Any, list[int]]]:
    """Indices of the shards of each process group, groups in a deterministic order."""
    by: dict[int, tuple[Any, list[int]]] = {}
    for i, s in enumerate(shards):
        if s.size > 1 and s.numel:
            by.setdefault(id(s.group), (s.group, []))[1].append(i)
    return sorted(by.values(), key=lambda g: sorted(dist.get_process_group_ranks(g[0])))


def all_gather_chunks(shards: list[FlatShard], chunks: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Every replica's owned chunks into `outs` (flat views of whole shards), one collective per
    group; shards of size 1 are copied locally."""
    gather = PendingGather(bucket_bytes=None)
    gather.launch(shards, chunks, outs)
    gather.wait_all()


@dataclass
class _GatherBucket:
    """One all-gather in flight: its buffer and the flat tensors it fills once done."""

    work: Any
    buf: torch.Tensor
    width: int  # elements each replica sends
    targets: list[tuple[FlatShard, torch.Tensor]]  # (shard, flat out) in the buffer's order
    sent: Optional[torch.Tensor] = None  # what the collective reads, kept alive until it is done
    on_done: Optional[Callable[[], None]] = None


class PendingGather:
    """ZeRO-1/2 updated weights gathered asynchronously (Megatron's overlap-param-gather).

    `launch` starts one all-gather per bucket (at most `bucket_bytes` of whole parameters of one
    process group, in the order given: the order the forward first uses them) and returns at once;
    `wait_for(out)` waits for the bucket holding one parameter and copies every replica's chunks of
    that bucket into their parameters; `wait_all` settles everything. Until a bucket is waited for,
    its parameters keep their old values (the collective writes into a buffer of its own), so a
    reader that waits first never sees a half-written tensor. Whoever reads or writes the
    parameters outside the forward waits first (the module's accessors and state-dict hooks do)."""

    def __init__(self, bucket_bytes: Optional[int] = BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes  # None: one collective per process group
        self._by_out: dict[int, _GatherBucket] = {}  # data pointer of a parameter -> its bucket in flight
        self._buckets: list[_GatherBucket] = []

    @property
    def pending(self) -> bool:
        return bool(self._buckets)

    @property
    def in_flight(self) -> int:
        """Buckets launched and not yet waited for."""
        return len(self._buckets)

    def launch(self, shards: list[FlatShard], chunks: list[torch.Tensor], outs: list[torch.Tensor],
               on_done: Optional[Callable[[list[int]], None]] = None) -> None:
        """Start gathering `chunks` (this replica's) into `outs`; `on_done(indices)` runs after the
        copies of a bucket's parameters (indices into the lists given here)."""
        self.wait_all()  # a parameter is never the target of two gathers at once
        local = [i for i, s in enumerate(shards) if s.size == 1 and s.numel]
        for i in local:
            outs[i].copy_(chunks[i].reshape(-1))
        if local and on_done is not None:
            on_done(local)
        for group, idx in _buckets(shards):
            for part in _split_bytes(idx, shards, outs, self.bucket_bytes):
                self._start(group, [shards[i] for i in part], [chunks[i] for i in part], [outs[i] for i in part],
                            None if on_done is None else functools.partial(on_done, part))

    def _start(self, group: Any, shards: list[FlatShard], chunks: list[torch.Tensor], outs: list[torch.Tensor],
               on_done: Optional[Callable[[], None]]) -> None:
        dtype = outs[0].dtype
        local = torch.cat([s.chunk_padded(c.to(dtype)) for s, c in zip(shards, chunks)])
        buf = local.new_empty(shards[0].size * local.numel())
        work = all_gather_flat(buf, local, group=group, async_op=True)
        bucket = _GatherBucket(work, buf, local.numel(), list(zip(shards, outs)), local, on_done)
        self._buckets.append(bucket)
        for o in outs:
            self._by_out[o.data_ptr()] = bucket

    def wait_for(self, t: torch.Tensor) -> None:
        """Settle the gather writing into `t` (a parameter), if one is in flight; earlier buckets
        (launched before it) are settled first, as the collectives complete in order anyway."""
        bucket = self._by_out.get(t.data_ptr()) if self._by_out else None
        if bucket is None:
            return
        while self._buckets:
            first = self._buckets[0]
            self._finish(first)
            if first is bucket:
                break

    def wait_all(self) -> None:
        while self._buckets:
            self._finish(self._buckets[0])

    def _finish(self, bucket: _GatherBucket) -> None:
        self._buckets.remove(bucket)
        bucket.work.wait()
        table = bucket.buf.view(-1, bucket.width)
        off = 0
        with torch.no_grad():
            for s, out in bucket.targets:
                self._by_out.pop(out.data_ptr(), None)
                out.copy_(table[:, off:off + s.chunk].reshape(-1)[:s.numel])
                off += s.chunk
        bucket.buf = bucket.sent = None
        if bucket.on_done is not None:
            bucket.on_done()


def _split_bytes(idx: list[int], shards: list[FlatShard], outs: list[torch.Tensor],
                 bucket_bytes: Optional[int]) -> list[list[int]]:
    """`idx` cut into consecutive runs of at most `bucket_bytes` of whole parameters (a larger one alone)."""
    if bucket_bytes is None:
        return [idx]
    out: list[list[int]] = [[]]
    size = 0
    for i in idx:
        n = shards[i].size * shards[i].chunk * outs[i].element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def reduce_scatter_layout(shards: list[FlatShard], grads: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The (size, sum of chunks) buffer a reduce-scatter of these shards' gradients sends, flat."""
    parts = [shards[i].padded(g) for i, g in enumerate(grads)]
    buf = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()
    if scale != 1.0:
        buf.mul_(scale)
    return buf.reshape(-1)


class _Box:
    """Carries a tensor into an autograd Function without making it a tracked input."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


class _Gathered(torch.autograd.Function):
    """Forward: the whole parameter (gathered beforehand); backward: its gradient goes to the
    owner, which reduce-scatters it to the chunk parameter."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, box: _Box, owner: "Zero3Params", key: int) -> torch.Tensor:
        ctx.owner, ctx.key = owner, key
        return box.t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.owner.grad_ready(ctx.key, grad)
        return None, None, None, None


@dataclass
class _SavedRef:
    """What autograd keeps instead of a gathered parameter (or a view of it)."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    # a weight gathered in float8: its scale and high-precision dtype (the operand is rebuilt from them)
    scale: Optional[torch.Tensor] = None
    orig_dtype: Optional[torch.dtype] = None


@dataclass
class _PendingReduce:
    work: Any
    out: torch.Tensor
    key: Optional[int]  # `out` is the whole (reduced) gradient of `key`; None: `out` holds chunks of `keys`
    keys: tuple[int, ...] = ()
    sent: Optional[torch.Tensor] = None  # what the collective reads, kept alive until it is done
    scale: float = 1.0  # applied to `out` once reduced (when `sent` is the gradient itself, unscaled)


@dataclass
class _UnitGather:
    """One all-gather of several parameters in flight; `wait` (by whichever of them is needed
    first) settles it and copies each parameter's slices of every rank's row into its own buffer."""

    work: Any
    buf: Optional[torch.Tensor]
    sent: Optional[torch.Tensor]
    parts: list[tuple[int, torch.Tensor]]  # (chunk elements, flat out), end to end in each rank's row
    # what a hang in its wait is named by (the flight recorder's OUTSIDE key), and the recorder told
    what: Any = None
    recorder: Any = None

    def wait(self) -> None:
        if self.work is None:
            return
        if self.recorder is not None:
            self.recorder.enter(OUTSIDE, self.what)
        self.work.wait()
        if self.recorder is not None:
            self.recorder.leave()
        rows = self.buf.view(-1, sum(c for c, _ in self.parts))  # one row per rank
        # The parts lie end to end in a row: one fused copy out (as FSDP2's split_with_sizes_copy),
        # not a slice and a copy per parameter.
        torch.split_with_sizes_copy(rows, [c for c, _ in self.parts], dim=1,
                                    out=[out.view(-1, c) for c, out in self.parts])
        self.work = self.buf = self.sent = None


class Zero3Params:
    """Stage-3 parameters: chunk Parameters on this rank, whole tensors only around their use."""

    def __init__(self, shards: list[FlatShard], chunks: list[torch.nn.Parameter], dp: int,
                 device: Optional[torch.device] = None):
        self.shards = shards
        self.chunks = chunks
        # Where whole parameters are gathered, when the chunks live elsewhere (in host memory under
        # offload="params": each chunk is copied to the device just before its gather); None: the
        # chunks' own device.
        self.device = None if device is None or device.type == "meta" else torch.device(device)
        self.scale = 1.0 / dp
        self.recorder: Any = None  # the flight recorder each wait for a gather or reduction is told to
        self._sync = True
        self._live: dict[int, int] = {}  # storage pointer of a gathered parameter -> its key
        self._in_forward = False
        self._regathered: dict[int, weakref.ref] = {}
        # The unit the forward fetched last, its whole parameters held (key -> flat whole) until the
        # forward ends, and then kept for the backward, whose first node reads them: FSDP2 leaves its root
        # module gathered for the same reason. Gathering them again right after letting them go would
        # cost one collective per step and no memory: the backward's first gather needs the same bytes
        # at the same moment. `_kept` lets each go once the backward is done with it.
        self._held_unit: Optional[tuple[int, ...]] = None
        self._held: dict[int, torch.Tensor] = {}
        self._kept: dict[int, torch.Tensor] = {}
        self._saved_order: list[int] = []  # keys in the order the forward saved them
        self._saved_at: dict[int, int] = {}
        # How many saved references of each key the forward left, and how many the backward has
        # unpacked: a key whose every reference was unpacked is done for this backward, and is
        # neither gathered again with its unit nor prefetched (without this, a layer's weights
        # already used were gathered a second time with the rest of their unit).
        self._saves: dict[int, int] = {}
        self._unpacks: dict[int, int] = {}
        self._done: set[int] = set()
        self._prefetched: dict[int, tuple[Any, torch.Tensor]] = {}
        self._accumulated: dict[int, torch.Tensor] = {}  # whole gradients kept under no_sync
        # A weight the forward used more than once (a tied embedding, read again as the head): how many
        # of its uses' gradients the backward is to deliver, and their sum so far. The sum is reduce-
        # scattered once, when the last arrives (at the latest when the reductions settle), as autograd
        # sums a tied weight's gradient in one process: one collective and one gradient's bytes on the
        # wire instead of one per use.
        self._uses: dict[int, int] = {}
        self._partial: dict[int, tuple[int, torch.Tensor]] = {}
        # The same forward reads such a weight again: its gathered buffer is held from the first use to
        # the last (`_reuse`: key -> the buffer and the uses still to come, as the previous forward
        # counted them) instead of gathered again for the second. The second use is the head after the
        # last layer, so the weight would be whole again at the forward's end, its peak, either way;
        # holding it costs memory only in the middle of the forward, and saves a collective each step.
        self._last_uses: dict[int, int] = {}
        self._reuse: dict[int, tuple[torch.Tensor, int]] = {}
        self._pending: list[_PendingReduce] = []
        # Gradients waiting to be reduce-scattered together: one collective per gather unit (a layer,
        # see `_unit_complete`) or per BUCKET_BYTES outside units, launched when the unit's last gradient
        # arrives or the bucket is full, and at the end of each backward.
        self._bucket: list[tuple[int, torch.Tensor]] = []
        self._bucket_bytes = 0
        self._fwd_prefetched: dict[int, tuple[Any, torch.Tensor]] = {}
        # Parameters gathered together (`gather_together`): key -> the keys of its unit, in use order.
        self._unit_of: dict[int, tuple[int, ...]] = {}
        self._unit_wants: dict[tuple[int, ...], frozenset] = {}  # a unit -> its keys whose gradients are reduce-scattered
        self._fetched: set[int] = set()  # keys the current forward has fetched
        self.gathers_launched = 0  # all-gather collectives started by forwards and backwards
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        # Weights all-gathered in float8 (`gather_in_float8`): their keys, the cast, and the scales of
        # the current forward (computed at its first float8 gather, for all of them at once).
        self._float8: frozenset[int] = frozenset()
        self._cast: Any = None
        self._scales: Optional[dict[int, torch.Tensor]] = None
        self._saved_scale: dict[int, torch.Tensor] = {}  # the scale each weight was saved with (backward)
        # Bytes every all-gather of a parameter received, by key (what the gathers cost on the wire).
        self.gathered_traffic: dict[int, int] = {}
        self._queued = False
        self.launched = 0  # gradient reductions started (tests read it to see no_sync work)
        # Set by a pipeline, which settles reductions itself between its tasks. Gradients summed
        # across pipeline stages (a tied embedding's copies) are then kept whole until the end of
        # the step: reducing them inside one stage's backward could wait on a stage that first
        # needs this one's gradients.
        self.in_pipeline = False

    # -- float8 all-gather ----------------------------------------------------------------------
    def gather_in_float8(self, keys: list[int], cast: Any) -> None:
        """Gather the weights `keys` (read only by float8 linears) as float8 with `cast`
        (kernels/float8.WeightCast): each replica casts its chunk with the weight's scale, the
        float8 bytes travel, and the forward gets the float8 operand the linear multiplies."""
        self._float8 = frozenset(keys)
        self._cast = cast if keys else None

    @property
    def float8_keys(self) -> frozenset:
        return self._float8

    def new_forward(self) -> None:
        """A forward begins: the float8 scales are computed again from the weights as they are now."""
        self._scales = None
        self._fetched.clear()

    def _scale(self, key: int) -> torch.Tensor:
        """The scale of float8 weight `key` in this forward. At the first one, every float8 weight's
        scale: the largest magnitude of each chunk, one all-reduce (MAX) per replica group for all of
        them, then torchao's scale of each maximum (so every replica casts with the whole weight's)."""
        if self._scales is None:
            keys = sorted(self._float8)
            scales: dict[int, torch.Tensor] = {}
            for group, idx in _buckets([self.shards[k] for k in keys]):
                chunks = [self._on_device(self.chunks[keys[i]].detach()) for i in idx]
                with torch.no_grad():
                    amax = torch.stack([c.abs().max().float() if c.numel() else c.new_zeros((), dtype=torch.float32)
                                        for c in chunks])
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
                    for i, sc in zip(idx, self._cast.scales(amax)):
                        scales[keys[i]] = sc
            self._scales = scales
        return self._scales[key]

    # -- forward ---------------------------------------------------------------------------------
    def fetch(self, key: int, prefetch: Optional[int] = None) -> torch.Tensor:
        """One whole parameter for the forward, just before its first use (the generated code binds
        `_P[i]` there and deletes it after the last use); the next one's gather is started now so
        it overlaps the ops in between. Nothing else keeps it: autograd saves a reference (see
        `_pack`), so the memory returns once the code drops it."""
        again = key in self._fetched  # a weight used twice (a tied embedding's second use, as the head)
        held = self._reuse.pop(key, None)
        if held is not None:  # gathered at its first use in this forward and held for this one
            buf, left = held
            if left > 1:
                self._reuse[key] = (buf, left - 1)
        else:
            if key not in self._fwd_prefetched:
                self._launch_unit(key, self._fwd_prefetched, self._fetched.__contains__)
            work, buf = self._fwd_prefetched.pop(key)
            work.wait()
            self._track(buf)
            left = self._last_uses.get(key, 1) - 1
            if self._in_forward and torch.is_grad_enabled() and not again and left > 0:
                self._reuse[key] = (buf, left)
        self._fetched.add(key)
        if prefetch is not None and prefetch not in self._fwd_prefetched and prefetch not in self._fetched:
            self._launch_unit(prefetch, self._fwd_prefetched, self._fetched.__contains__)
        s = self.shards[key]
        whole = self._whole(key, buf)
        if self._in_forward:
            self._live[buf.untyped_storage().data_ptr()] = (key, weakref.ref(buf))
            if torch.is_grad_enabled():  # a float8 weight's float8 values: the backward casts them with the saved scale
                self._hold(key, whole, again)
        if torch.is_grad_enabled():
            self._uses[key] = self._uses.get(key, 0) + 1
        if key in self._float8:
            whole = self._cast.operand(whole.view(s.shape), self._scale(key), self.chunks[key].dtype)
        else:
            whole = whole.view(s.shape)
        return _Gathered.apply(self.chunks[key], _Box(whole), self, key) if torch.is_grad_enabled() else whole

    @property
    def kept_for_backward(self) -> frozenset:
        """Keys of the whole parameters the last forward left gathered for the backward (see `_held`)."""
        return frozenset(self._kept)

    def _hold(self, key: int, whole: torch.Tensor, again: bool) -> None:
        """Hold `whole` while its unit is the last one the forward fetched (see `_held`). A weight
        fetched `again` (its unit's first use is behind) joins the unit in use: a tied embedding read
        again as the head is held with the final norm before it."""
        unit = self._unit_of.get(key, (key,))
        if unit != self._held_unit and not again:
            self._held_unit, self._held = unit, {}
        self._held[key] = whole

    def _keep_last_unit(self) -> None:
        """The forward ended: what it holds of its last unit and saved for backward stays, known to
        `_unpack` as gathered (a parameter the backward does not read is let go now)."""
        held, self._held, self._held_unit = self._held, {}, None
        self._kept = {k: w for k, w in held.items() if k in self._saved_at}
        for k, w in self._kept.items():
            self._regathered[k] = weakref.ref(w)

    def prefetch_forward(self, key: int) -> None:
        """Start gathering the unit of `key`, the parameter the next forward reads first, before that
        forward (collective: every rank calls it at the same point, whatever its batch, since nothing of
        the batch travels). `train_step` calls it between starting and waiting for the step's agreement
        on batch sizes, so the two collectives' latencies overlap. A unit with float8 weights is left to
        the forward, whose first float8 gather computes this forward's scales."""
        for work, _ in self._fwd_prefetched.values():  # an earlier one whose forward never came: stale
            work.wait()
        self._fwd_prefetched.clear()
        unit = self._unit_of.get(key, (key,))
        if self.shards[key].size <= 1 or any(k in self._float8 for k in unit):
            return
        self._launch_unit(key, self._fwd_prefetched, lambda k: False)

    def _whole(self, key: int, buf: torch.Tensor) -> torch.Tensor:
        """The flat whole parameter in a gathered buffer (float8 values for a float8 weight)."""
        return buf[:self.shards[key].numel]

    def _track(self, buf: torch.Tensor) -> None:
        """Count the bytes of whole parameters alive now (a test reads the forward's peak)."""
        n = buf.numel() * buf.element_size()
        self.gathered_bytes += n
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        weakref.finalize(buf, self._untrack, n)

    def _untrack(self, n: int) -> None:
        self.gathered_bytes -= n

    def gather(self, keys: list[int]) -> dict[int, torch.Tensor]:
        """The whole parameters `keys`, outside any forward (whole state dicts), one collective per
        group; the forward gathers through `fetch`."""
        shards = [self.shards[k] for k in keys]
        outs = [torch.empty(s.numel, dtype=self.chunks[k].dtype, device=self.device or self.chunks[k].device)
                for k, s in zip(keys, shards)]
        with torch.no_grad():
            all_gather_chunks(shards, [self._on_device(self.chunks[k].detach()) for k in keys], outs)
        return {k: flat.view(s.shape) for k, s, flat in zip(keys, shards, outs)}

    @contextlib.contextmanager
    def forward_scope(self, on_save: Optional[Callable[[Any], None]] = None) -> Iterator[None]:
        """Around a forward: what autograd saves of gathered parameters is a reference, not the tensor.

        `on_save` sees what is kept of every other tensor autograd saves (saved-tensor hooks do not
        nest, so a caller that measures activations passes its counter here instead of its own
        hooks): the tensor, or the shard of an all-gathered one (`collectives.saved_bytes` sizes both)."""
        for work, _ in self._prefetched.values():  # meant for a backward that never came
            work.wait()
        self._prefetched.clear()
        self._forget_saved()
        self._fetched.clear()
        self._kept.clear()  # kept for a backward that never came
        if self._uses:  # the last forward's count of each weight's uses: this one reads them alike
            self._last_uses = dict(self._uses)
        self._uses.clear()

        def pack(t: torch.Tensor) -> Any:
            out = self._pack(t)
            if out is t:
                out = pack_saved(t)
                if on_save is not None:
                    on_save(out)
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            self._in_forward = True
            completed = False
            try:
                yield
                completed = True
            finally:
                self._in_forward = False
                if completed and torch.is_grad_enabled():
                    self._keep_last_unit()
                    POOL.release_idle()  # the step's peak: idle gather buffers hold no pages through it
                self._held, self._held_unit = {}, None
                self._reuse.clear()
                self._live.clear()
                for work, _ in self._fwd_prefetched.values():  # started for a use that never came
                    work.wait()
                self._fwd_prefetched.clear()

    def _pack(self, t: torch.Tensor) -> Any:
        scale = orig = None
        inner = t
        if self._cast is not None and is_float8(t):
            inner, scale, orig = self._cast.parts(t)
        entry = self._live.get(inner.untyped_storage().data_ptr()) if inner.device.type != "meta" else None
        if entry is None:
            return t
        key, alive = entry
        if alive() is None:  # that parameter is gone; its memory is another tensor's now
            return t
        if key not in self._saved_at:
            self._saved_at[key] = len(self._saved_order)
            self._saved_order.append(key)
        self._saves[key] = self._saves.get(key, 0) + 1
        if scale is not None:
            self._saved_scale[key] = scale
        return _SavedRef(key, tuple(inner.size()), tuple(inner.stride()), inner.storage_offset(), scale, orig)


    # -- gathers, one collective per unit ------------------------------------------------------
    def gather_together(self, units: list[list[int]]) -> None:
        """Parameters used together (a layer's, as FSDP wraps a block): the first one a forward or
        a backward needs starts one all-gather for all of them (per process group and wire dtype),
        and the next unit's starts while the last of this one is in use. One collective per
        parameter would pay each collective's fixed cost dozens of times per layer."""
        self._unit_wants.clear()  # asked again: a weight frozen since gets no gradient to wait for
        for unit in units:
            for k in unit:
                self._unit_of[k] = tuple(unit)

    def units(self) -> dict[int, tuple[int, ...]]:
        """Each parameter's gather unit (`gather_together`): key -> the keys gathered, and their
        gradients reduce-scattered, together."""
        return dict(self._unit_of)

    def _held_in_backward(self, k: int) -> bool:
        """Whether backward must not gather `k` again: whole and still held by some node, not
        saved by this forward, or done (every reference it saved unpacked): backward will not ask
        for it, or has it."""
        ref = self._regathered.get(k)
        return k not in self._saved_at or k in self._done or (ref is not None and ref() is not None)

    def _forget_saved(self) -> None:
        """What one forward saved and one backward unpacked, gone (a new forward, or the step's end)."""
        self._saved_order.clear()
        self._saved_at.clear()
        self._saves.clear()
        self._unpacks.clear()
        self._done.clear()

    def _next_needed(self, key: int) -> Optional[int]:
        """The parameter backward will need after `key`: the nearest one saved before it in the
        forward that backward is not done with (None at the first)."""
        at = self._saved_at.get(key, 0)
        for j in range(at - 1, -1, -1):
            k = self._saved_order[j]
            if k not in self._done:
                return k
        return None

    def _launch_unit(self, key: int, table: dict[int, tuple[Any, torch.Tensor]], skip: Callable[[int], bool],
                     scales: Optional[dict[int, Optional[torch.Tensor]]] = None) -> None:
        """Start gathering `key` and the rest of its unit not in `table` nor `skip`ped, into `table`:
        one collective per process group and wire dtype. A float8 weight travels with `scales`' or
        the saved scale (backward), else this forward's."""
        keys = [key] + [k for k in self._unit_of.get(key, ()) if k != key and k not in table and not skip(k)
                        and self.shards[k].size > 1 and self.shards[k].numel]
        scales = dict(scales or {})
        if not self._in_forward:  # backward: float8 weights again with the scale they were saved with
            for k in keys:
                if k in self._float8 and scales.get(k) is None:
                    scales[k] = self._saved_scale.get(k)
        by: dict[tuple, list[int]] = {}
        for k in keys:
            wire = torch.uint8 if k in self._float8 else self.chunks[k].dtype
            by.setdefault((id(self.shards[k].group), wire), []).append(k)
        for ks in by.values():
            if len(ks) == 1:
                table[ks[0]] = self._launch_gather(ks[0], scales.get(ks[0]))
            else:
                table.update(self._launch_bucket(ks, scales))

    def _send_chunk(self, key: int, scale: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of `key` as it travels: float8 bytes cast with the scale, or as stored."""
        c = self._on_device(self.chunks[key].detach())
        if key in self._float8:
            with torch.no_grad():
                c = self._cast.cast(c, self._scale(key) if scale is None else scale).view(torch.uint8)
        return c

    def words(self, how: str, keys: Any) -> tuple[str, str]:
        """A gather's or a reduction's name for hang reports, and the parameters it serves."""
        names = [self.shards[k].fqn for k in keys]
        held = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        what = "parameters" if how == "all-gather" else "gradients"
        n = len(names)
        return f"ZeRO-3 {how} of {n} {what if n > 1 else what[:-1]}", f"the {what} of {held}"

    def _launch_bucket(self, keys: list[int], scales: dict[int, Optional[torch.Tensor]]) -> dict[int, tuple[Any, torch.Tensor]]:
        """One all-gather for several parameters of one group: each rank sends its padded chunks end
        to end; once done, every parameter's whole flat tensor is copied out into its own buffer
        (so each is freed on its own, as a parameter gathered alone)."""
        sends = [(k, self._send_chunk(k, scales.get(k))) for k in keys]
        shard = self.shards[keys[0]]
        sent = torch.cat([self.shards[k].chunk_padded(c) for k, c in sends])
        buf = self._gather_buffer(shard.size * sent.numel(), sent)
        work = all_gather_flat(buf, sent, group=shard.group, async_op=True)
        self.gathers_launched += 1
        bucket = _UnitGather(work, buf, sent, [], self.words("all-gather", keys), self.recorder)
        out: dict[int, tuple[Any, torch.Tensor]] = {}
        for k, c in sends:
            s = self.shards[k]
            flat = self._gather_buffer(s.size * s.chunk, c)
            self.gathered_traffic[k] = self.gathered_traffic.get(k, 0) + flat.numel() * flat.element_size()
            bucket.parts.append((s.chunk, flat))
            out[k] = (bucket, flat.view(self._cast.dtype) if k in self._float8 else flat)
        return out

    def _gather_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Where a gathered weight lands. In the forward, from the pool of mapped host buffers
        (host_buffers.py): activations only accumulate there, so a freed heap buffer's pages would
        be reused only in part and the heap would grow by the rest. In the backward, from the heap,
        as the reduce-scatter's buffers: the backward frees activations and their gradients as it
        goes, and a heap buffer reuses their pages where a pooled one keeps pages of its own
        resident (GPT-2 shape on 4 CPU processes: a rank's peak 7 MiB lower, the step no slower)."""
        if self._in_forward:
            return transient_empty(numel, like)
        return like.new_empty(numel)

    def _launch_gather(self, key: int, scale: Optional[torch.Tensor] = None) -> tuple[Any, torch.Tensor]:
        """Start gathering one parameter; the buffer is its flat tensor (padded) once the work is done.
        A float8 weight travels as the float8 bytes of its chunk cast with `scale` (default: this
        forward's), as bytes (float8 is not a dtype every backend takes); the buffer returned is
        their float8 view (the object whose lifetime tells the saved-tensor hooks it is alive)."""
        s, c = self.shards[key], self._send_chunk(key, scale)
        buf = self._gather_buffer(s.size * s.chunk, c)
        self.gathered_traffic[key] = self.gathered_traffic.get(key, 0) + buf.numel() * buf.element_size()
        work = all_gather_flat(buf, s.chunk_padded(c), group=s.group, async_op=True)
        self.gathers_launched += 1
        return work, (buf.view(self._cast.dtype) if key in self._float8 else buf)

    def keep_on_host(self, host_copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Move chunks that live on the device into host memory (offload="params"), in place: the
        Parameters stay the same objects, so optimizers and module references keep working.
        Chunks materialized after `chunk_parameters` (a model built on meta) land here."""
        for c in self.chunks:
            if c.device.type not in ("cpu", "meta"):
                if self.device is None:
                    self.device = c.device
                c.data = host_copy(c.data)

    def _on_device(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk where gathers run (a copy from host memory under offload="params")."""
        if self.device is None or chunk.device == self.device:
            return chunk
        return chunk.to(self.device, non_blocking=True)

    def _unpack(self, saved: Any) -> torch.Tensor:
        """Backward needs a gathered parameter: reuse it while some node still holds it, else take
        the prefetched one or gather it now; then start gathering the one backward needs next (the
        one saved before it in the forward), so that gather overlaps this node's compute."""
        if not isinstance(saved, _SavedRef):
            return unpack_saved(saved)
        key = saved.key
        ref = self._regathered.get(key)
        whole = ref() if ref is not None else None
        if whole is None:
            if key not in self._prefetched:
                self._launch_unit(key, self._prefetched, self._held_in_backward, {key: saved.scale})
            work, buf = self._prefetched.pop(key)
            work.wait()
            whole = self._whole(key, buf)
            self._regathered[key] = weakref.ref(whole)
        count = self._unpacks[key] = self._unpacks.get(key, 0) + 1
        if count >= self._saves.get(key, 0):
            self._done.add(key)
            self._kept.pop(key, None)  # the nodes that read it hold their views
        nxt = self._next_needed(key)
        if nxt is not None and nxt not in self._prefetched and not self._held_in_backward(nxt):
            self._launch_unit(nxt, self._prefetched, self._held_in_backward)
        view = whole.as_strided(saved.size, saved.stride, saved.offset)
        if saved.scale is not None:  # the float8 operand the forward saved, from the same float8 values
            return self._cast.operand(view, saved.scale, saved.orig_dtype)
        return view

    # -- backward --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.syncing(False):
            yield

    @property
    def sync(self) -> bool:
        return self._sync

    @contextlib.contextmanager
    def syncing(self, on: bool) -> Iterator[None]:
        """Backward passes inside reduce their gradients (on) or keep them whole here (off)."""
        old, self._sync = self._sync, bool(on)
        try:
            yield
        finally:
            self._sync = old

    def grad_ready(self, key: int, grad: torch.Tensor) -> None:
        uses = self._uses.get(key, 1)
        if uses > 1:  # one use's gradient of a weight used several times: summed here first (`_uses`)
            arrived, acc = self._partial.pop(key, (0, None))
            grad = grad.detach() if acc is None else acc + grad
            if arrived + 1 < uses:
                self._partial[key] = (arrived + 1, grad)
                self._settle_at_end()
                return
        self._accept(key, grad)

    def _settle_at_end(self) -> None:
        """Have this backward's end settle its reductions (a pipeline settles them itself)."""
        if self._sync and not self._queued and not self.in_pipeline:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _accept(self, key: int, grad: torch.Tensor) -> None:
        """A whole gradient of `key`, every use's summed: reduced now, or kept under no_sync."""
        if not self._sync or (self.in_pipeline and self.shards[key].sum_group is not None):
            acc = self._accumulated.get(key)
            self._accumulated[key] = grad.detach().clone() if acc is None else acc.add_(grad)
            return
        acc = self._accumulated.pop(key, None)
        if acc is not None:
            grad = acc.add_(grad)
        self._reduce(key, grad)
        self._settle_at_end()

    def _reduce(self, key: int, grad: torch.Tensor) -> None:
        s = self.shards[key]
        if s.sum_group is not None:  # summed over more devices than the replicas: whole, then our chunk
            buf = grad.detach().reshape(-1) * self.scale
            work = dist.all_reduce(buf, group=s.sum_group, async_op=True)
            self._pending.append(_PendingReduce(work, buf, key))
        elif s.size > 1:
            nbytes = grad.numel() * grad.element_size()
            unit = self._unit_of.get(key)
            if self._bucket and (self.shards[self._bucket[0][0]].group is not s.group
                                 or self._bucket[0][1].dtype != grad.dtype
                                 or self._unit_of.get(self._bucket[0][0]) != unit
                                 or self._bucket_bytes + nbytes > BUCKET_BYTES):
                self.flush()  # a bucket never grows past BUCKET_BYTES by a large gradient: that one goes alone
            self._bucket.append((key, grad.detach()))
            self._bucket_bytes += nbytes
            if self._bucket_bytes >= BUCKET_BYTES or (unit is not None and self._unit_complete(unit)):
                self.flush()
            return
        else:
            self._pending.append(_PendingReduce(None, grad.detach().reshape(-1).clone(), key))
        self.launched += 1

    def _unit_complete(self, unit: tuple[int, ...]) -> bool:
        """Whether the bucket holds the gradient of every parameter of `unit` that gets one reduce-
        scattered: a layer's gradients then travel as soon as its backward is done, one collective per
        layer as FSDP's, and its whole gradients are let go while the layers below still compute
        (one bucket of BUCKET_BYTES would hold a small model's every whole gradient to the end)."""
        want = self._unit_wants.get(unit)
        if want is None:  # once per unit, not at every gradient of the backward
            want = self._unit_wants[unit] = frozenset(
                k for k in unit
                if self.shards[k].size > 1 and self.shards[k].sum_group is None and self.chunks[k].requires_grad)
        return len(want) <= len(self._bucket) and want.issubset(k for k, _ in self._bucket)

    def flush(self) -> None:
        """Start the reduce-scatter of the gradients gathered in the bucket."""
        if not self._bucket:
            return
        keys = tuple(k for k, _ in self._bucket)
        shards = [self.shards[k] for k in keys]
        grads = [g for _, g in self._bucket]
        self._bucket, self._bucket_bytes = [], 0
        if len(keys) == 1 and shards[0].size * shards[0].chunk == grads[0].numel():
            # One gradient that splits evenly (a large weight fills a bucket alone): sent as it is and
            # scaled once reduced, never copied whole (a vocabulary embedding's gradient is the
            # largest tensor of a step).
            buf, post = grads[0].reshape(-1), self.scale
        else:
            # from the heap, as the backward's gathered weights (see _gather_buffer)
            buf, post = reduce_scatter_layout(shards, grads, self.scale), 1.0
        del grads
        out = buf.new_empty(sum(sh.chunk for sh in shards))
        work = reduce_scatter.start(out, buf, shards[0].group)
        self._pending.append(_PendingReduce(work, out, None, keys, sent=buf, scale=post))
        self.launched += 1
        # A reduction in flight holds its bucket's whole gradients: at most MAX_IN_FLIGHT at once
        # (else every layer's whole gradients live until the end of backward, a whole model's worth).
        in_flight = [p for p in self._pending if p.work is not None]
        if len(in_flight) > MAX_IN_FLIGHT:
            in_flight[0].work.wait()
            in_flight[0].work = in_flight[0].sent = None

    def reduce_accumulated(self) -> None:
        """Reduce the gradients kept under no_sync (after a step whose backward ran without sync)."""
        for key in sorted(self._accumulated):
            self._reduce(key, self._accumulated.pop(key))
        self.finish()

    def drop_accumulated(self) -> None:
        """Forget the whole gradients kept under no_sync (the module's gradients were zeroed)."""
        self._accumulated.clear()
        self._partial.clear()

    def reduce_across_stages(self) -> None:
        """A pipeline's step end: reduce the gradients summed across stages, kept whole until now."""
        for key in sorted(k for k in self._accumulated if self.shards[k].sum_group is not None):
            self._reduce(key, self._accumulated.pop(key))

    def settle(self) -> None:
        """Wait for the reductions started so far and add each chunk to its gradient."""
        partial, self._partial = self._partial, {}
        for key in sorted(partial):  # a use the backward did not reach gave no gradient: the rest are the sum
            self._accept(key, partial[key][1])
        self.flush()
        pending, self._pending = self._pending, []
        pending.reverse()
        # A bucket's reduced buffer is read by nothing else: each chunk's gradient is a view of it (as
        # a DDP bucket's with gradient_as_bucket_view), not a copy, and an allocation, per parameter.
        # A whole gradient's buffer is let go once our chunk of it is copied out.
        while pending:
            p = pending.pop()
            if p.work is not None:
                if self.recorder is not None:
                    self.recorder.enter(OUTSIDE, self.words("reduce-scatter", [p.key] if p.key is not None else p.keys))
                p.work.wait()
                if self.recorder is not None:
                    self.recorder.leave()
            p.sent = None
            if p.scale != 1.0:
                p.out.mul_(p.scale)
            if p.key is not None:  # a whole gradient: keep our chunk
                self._add_grad(p.key, self.shards[p.key].owned(p.out))
                continue
            off = 0  # a bucket: the chunks of its gradients one after another (reduce_scatter_layout)
            for key in p.keys:
                sh = self.shards[key]
                self._add_grad(key, p.out[off:off + sh.hi - sh.lo], own=True)
                off += sh.chunk
            del p

    def _add_grad(self, key: int, g: torch.Tensor, own: bool = False) -> None:
        """Add a reduced chunk to the chunk parameter's gradient; `own`: `g` is (a view of) a buffer
        nothing else reads, which becomes the gradient itself instead of a copy."""
        c = self.chunks[key]
        g = g.reshape(c.shape).to(device=c.device, dtype=c.dtype)
        if c.grad is None:
            c.grad = g if own else g.clone()
        else:
            c.grad.add_(g)

    def finish(self) -> None:
        self.settle()
        self._regathered.clear()
        self._kept.clear()
        for work, _ in self._prefetched.values():  # gathered for a backward that did not need it
            work.wait()
        self._prefetched.clear()
        self._forget_saved()
        self._fetched.clear()
        self._saved_scale.clear()
        self._queued = False
