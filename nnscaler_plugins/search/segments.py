"""Per-segment sums of a placed graph: what the simulator replays and what the search composes.

Walking the ops of a graph in order with a placement for each, every op's compute, the resharding
its inputs need, the gradient sums its backward needs and the tensors its backward keeps are added
to the op's *segment*. The simulator's segments are pipeline stages; the search's are the parts of
a model it solves separately (the ops before the layers, each layer, the ops after them), which it
then adds up into the stages of many candidate pipelines without walking the graph again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.search import group_kernels
from nnscaler_plugins.search.costmodel import CostModel, Training, gathered_from_pieces
from nnscaler_plugins.search.layouts import Placement


@dataclass
class Group:
    """A recompute group inside a segment: run again in backward instead of keeping its activations."""

    saved: dict = field(default_factory=dict)  # storage -> bytes its ops would keep (rebuilt in backward)
    inputs: dict = field(default_factory=dict)  # storage -> bytes of what it reads from outside (kept)
    shared: dict = field(default_factory=dict)  # the part of `inputs` made outside the layers (kept once)
    fwd: float = 0.0
    fwd_comm: float = 0.0
    # what a checkpointing policy keeps of the group's own outputs (`Walker(keep_output=...)`): those
    # storages stay from forward to backward, and the ops and collectives making them are not run again
    kept: dict = field(default_factory=dict)  # storage -> bytes
    kept_fwd: float = 0.0
    kept_comm: float = 0.0


@dataclass
class Segment:
    """Sums over the ops of one segment, for one micro-batch (times in seconds, sizes in bytes)."""

    fwd: float = 0.0  # op compute, forward
    bwd_input: float = 0.0  # op compute, gradients of activations
    bwd_weight: float = 0.0  # op compute, gradients of parameters
    fwd_comm: float = 0.0  # resharding in forward (synchronous, on the critical path)
    bwd_comm: float = 0.0  # its duals and the gradient sums of inputs read whole by split ops
    flops: float = 0.0  # model FLOPs of one piece, forward + backward
    core_fwd: float = 0.0  # forward time of attention-core ops (recomputed under selective)
    act: dict = field(default_factory=dict)  # storage -> bytes the backward keeps (ops in no group)
    core_act: dict = field(default_factory=dict)  # storage -> bytes kept by attention-core ops
    groups: dict = field(default_factory=dict)  # recompute group -> Group
    incoming: dict = field(default_factory=dict)  # values made in other segments -> bytes of the whole tensor
    # parameters: storage value -> (local elements, devices holding it, gradient partial-group size)
    params: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)  # value -> (local bytes, devices)
    backward_working_set: float = 0.0  # the largest gradient working set of one op's backward (bytes)

    @property
    def activations(self) -> float:
        """Everything the backward would keep without recomputation."""
        total = dict(self.act)
        for g in self.groups.values():
            for k, b in g.saved.items():
                total[k] = max(total.get(k, 0.0), b)
        return sum(total.values())

    def kept(self, recompute: str) -> tuple[dict, dict]:
        """(storage -> bytes kept per micro-batch, the shared part) under a recomputation mode:
        "none" keeps everything, "selective" drops what attention cores keep, "groups" runs the
        segment's recompute groups again in backward and keeps only their inputs."""
        if recompute == "groups" and self.groups:
            kept = dict(self.act)
            shared: dict = {}
            for g in self.groups.values():
                for k, b in list(g.inputs.items()) + list(g.kept.items()):
                    kept[k] = max(kept.get(k, 0.0), b)
                for k, b in g.shared.items():
                    shared[k] = max(shared.get(k, 0.0), b)
            for k in shared:
                kept.pop(k, None)
            return kept, shared
        kept = dict(self.act)
        for g in self.groups.values():
            for k, b in g.saved.items():
                kept[k] = max(kept.get(k, 0.0), b)
        if recompute == "selective":
            for k in self.core_act:
                kept.pop(k, None)
        return kept, {}

    def transient(self, recompute: str) -> float:
        """Extra bytes while a backward rebuilds the largest recompute group."""
        if recompute == "groups":
            return max((sum(b for k, b in g.saved.items() if k not in g.kept) for g in self.groups.values()),
                       default=0.0)
        return 0.0

    def recompute_time(self, recompute: str) -> tuple[float, float]:
        """(compute, communication) re-run in backward under a recomputation mode."""
        if recompute == "groups":
            return (sum(g.fwd - g.kept_fwd for g in self.groups.values()),
                    sum(g.fwd_comm - g.kept_comm for g in self.groups.values()))
        if recompute == "selective":
            return self.core_fwd, 0.0
        return 0.0, 0.0

    def act_bytes(self, recompute: str) -> float:
        kept, _ = self.kept(recompute)
        return sum(kept.values())


def itemsize(dtype: torch.dtype, training: Training) -> int:
    if dtype.is_floating_point:
        return training.act_bytes
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype).element_size()


class Walker:
    """One walk over the ops; `run` fills one `Segment` per segment index."""

    def __init__(self, graph: Graph, cm: CostModel, training: Training, num_segments: int,
                 to_global: Callable[[int], int] = lambda d: d, sp_layers: Optional[set] = None,
                 layer_segments: Optional[set] = None, group_of: Optional[Callable[[str], Any]] = None,
                 cp_comm: str = "ring", keep_output: Optional[Callable[[str], bool]] = None):
        self.graph, self.cm, self.t = graph, cm, training
        self.cp_comm = cp_comm  # how attention split along its sequence meets its keys (the plan's option)
        self.segments = [Segment() for _ in range(num_segments)]
        self.to_global = to_global
        self.sp_ops = sp_layers or set()  # ops where sequence parallelism (the plan option) applies
        self.layer_segments = set(range(num_segments)) if layer_segments is None else set(layer_segments)
        self.group_of = group_of or (lambda name: None)  # recompute group of an op (None: kept)
        # a checkpointing policy inside the groups: ops whose outputs are kept rather than recomputed
        self.keep_output = keep_output
        # (src segment, dst segment) -> bytes per micro-batch crossing, and the part needing gradients
        self.boundary: dict[tuple[int, int], float] = {}
        self.boundary_grad: dict[tuple[int, int], float] = {}
        self.core_storage = self._core_storage()

    def _core_storage(self) -> set:
        costs = self.cm.costs
        out = set()
        for op in self.graph.ops:
            c = costs.ops[op.name]
            if c.core:
                out.update(o for o in op.outputs if o is not None)
                if c.saved_masks:
                    out.add(f"{op.name}:mask")
        return out

    def run(self, ops: Sequence, placement_of: Callable[[str], Placement], segment_of: Callable[[str], int],
            cross_segment: Callable[[int, int], bool] = lambda a, b: a != b) -> list[Segment]:
        """Walk `ops` (graph order). `cross_segment(a, b)` says whether a value made in segment a and
        read in segment b moves between device groups (pipeline stages) rather than staying put."""
        g, cm, t = self.graph, self.cm, self.t
        costs = cm.costs
        produced: dict[str, tuple[Layout, int]] = {}
        storage: dict[str, tuple[Layout, int]] = {}
        delivered: set = set()
        sp = t.sequence_parallel
        regather = cm.cluster.efficiency.regather_saved_inputs
        made_by: dict[str, Any] = {}  # value -> recompute group of its producer
        gathered: dict[str, float] = {}  # value -> the piece of it kept, for views of gathered values
        copies: dict[str, list[int]] = {}  # weight -> the segments holding a copy of it (one per device group)
        copy_layout: dict[tuple[str, int], tuple[Layout, int]] = {}
        for op in ops:
            name = op.name
            k = segment_of(name)
            seg = self.segments[k]
            p = placement_of(name)
            c = costs.ops[name]
            gid = self.group_of(name)
            group = seg.groups.setdefault(gid, Group()) if gid is not None else None
            comm_before = seg.fwd_comm
            shard = p.replicate if (sp and name in self.sp_ops and c.kind == "memory" and not p.splits
                                    and p.replicate > 1) else 1
            ot = cm.op_time(name, p, t, shard)
            special = group_kernels.price(cm, op, p, t, self.cp_comm, self.to_global)
            if special is not None:  # a kernel talking to its group: its own price (group_kernels)
                ot = special.time
                seg.fwd_comm += special.fwd_comm
                seg.bwd_comm += special.bwd_comm
                if special.kept > 0:
                    target = group.saved if group is not None else seg.act
                    target[f"{name}:kernel"] = special.kept
            seg.fwd += ot.fwd
            seg.bwd_input += ot.bwd_input
            seg.bwd_weight += ot.bwd_weight
            seg.flops += ot.flops * 3 if c.needs_grad else ot.flops
            if c.core:
                seg.core_fwd += ot.fwd
            keeps = group is not None and self.keep_output is not None and self.keep_output(name)
            if group is not None:
                group.fwd += ot.fwd
                if keeps:
                    group.kept_fwd += ot.fwd
            ins, outs, grads = cm.layouts(name, p)
            kept: dict[int, float] = {}  # input -> fraction of it the backward keeps (a gathered input's shard)
            view_of_gathered = None
            for i, v in enumerate(op.inputs):
                val = g.values[v]
                if val.meta is None or ins[i] is None:
                    continue
                need = ins[i]
                isz = itemsize(val.meta.dtype, t)
                needs_grad = val.meta.requires_grad and op.grad_enabled
                if val.kind in ("param", "buffer", "constant"):
                    # a weight read on another device group (a tied embedding on the last pipeline stage)
                    # is a copy there, with its own states, as the runtime keeps it
                    held = next((h for h in copies.get(v, ()) if not cross_segment(h, k)), None)
                    if held is None:
                        copies.setdefault(v, []).append(k)
                        storage.pop(v, None)
                    elif storage.get(v, (None, held))[1] != held:
                        storage[v] = copy_layout[(v, held)]
                    if v not in storage:
                        lay = Layout(need.shape, need.group, need.replicas * need.partial, 1, need.splits, need.blocks)
                        storage[v] = (lay, k)
                        copy_layout[(v, k)] = storage[v]
                        local = math.prod(lay.local_shape())
                        if val.kind == "param" and val.meta.requires_grad:
                            seg.params[v] = (local, tuple(sorted(set(lay.group))), grads[i])
                        else:
                            seg.buffers[v] = (local * isz, tuple(sorted(set(lay.group))))
                    src, sk = storage[v]
                    if val.kind == "param" and v in self.segments[sk].params:
                        el, devs, part = self.segments[sk].params[v]
                        if grads[i] > part:
                            self.segments[sk].params[v] = (el, devs, grads[i])
                    if src != need and (v, need) not in delivered and set(src.group) == set(need.group):
                        delivered.add((v, need))
                        f, b = cm.reshard(src, need, isz, self.to_global)
                        seg.fwd_comm += f
                        seg.bwd_comm += b if needs_grad else 0.0
                    continue
                if val.kind == "input" or v not in produced:
                    src, sk = Layout.replicated(need.shape, need.group), k
                else:
                    src, sk = produced[v]
                if group is not None and made_by.get(v) != gid and val.meta.dtype.is_floating_point:
                    base = costs.storage(v)
                    local = math.prod(src.local_shape()) * isz
                    if sp and name in self.sp_ops:
                        local /= max(1, src.replicas * src.partial)  # sequence parallelism keeps it sharded
                    if sk not in self.layer_segments or val.kind == "input":
                        group.shared[base] = max(group.shared.get(base, 0.0), local)
                    group.inputs[base] = max(group.inputs.get(base, 0.0), local)
                if sk != k:
                    if (v, k) not in delivered:
                        delivered.add((v, k))
                        seg.incoming[v] = val.meta.numel * isz
                        if cross_segment(sk, k):
                            nbytes = val.meta.numel * isz
                            self.boundary[(sk, k)] = self.boundary.get((sk, k), 0.0) + nbytes
                            if needs_grad:
                                self.boundary_grad[(sk, k)] = self.boundary_grad.get((sk, k), 0.0) + nbytes
                    if cross_segment(sk, k):
                        src = Layout.replicated(need.shape, need.group)
                if src != need and (v, need) not in delivered:
                    delivered.add((v, need))
                    f, b = cm.reshard(src, need, isz, self.to_global)
                    seg.fwd_comm += f
                    seg.bwd_comm += b if needs_grad else 0.0
                    if group is not None and self.keep_output is not None and src.partial > 1:
                        # a checkpointing policy keeps the result of a reduction of partial sums (torchtitan
                        # saves its reduce-scatters' outputs): not communicated again in backward
                        group.kept_comm += f
                        group.kept[f"{v}:reduced"] = math.prod(need.local_shape()) * isz
                # (a view of) a value gathered from pieces: the runtime keeps the piece for the backward
                # of a consumer whose gradient is partial and gathers it again there, with a
                # reduce-scatter of the gradient where an all-reduce was (the same traffic)
                piece = (math.prod(src.local_shape()) / math.prod(need.local_shape())
                         if gathered_from_pieces(src, need) else gathered.get(v) if src == need else None)
                if piece is not None and c.kind == "view" and view_of_gathered is None:
                    view_of_gathered = piece
                if piece is not None and grads[i] > 1 and needs_grad and regather:
                    kept[i] = piece
                if grads[i] > 1 and needs_grad:
                    local = math.prod(need.local_shape()) * isz
                    members = [self.to_global(d) for d in sorted(p.devices)[:grads[i]]]
                    if piece is not None and not regather:
                        # kept whole: the gradient goes back to the pieces by one reduce-scatter
                        seg.bwd_comm += cm.reduce_scatter(local, members)
                    else:  # an all-reduce; for a kept shard, the reduce-scatter plus the gather again
                        seg.bwd_comm += cm.all_reduce(local, members)
            for j, v in enumerate(op.outputs):
                if keeps and v is not None and j < len(outs) and outs[j] is not None and \
                        g.values[v].meta is not None and g.values[v].meta.dtype.is_floating_point:
                    base = costs.storage(v)
                    group.kept[base] = max(group.kept.get(base, 0.0),
                                           math.prod(outs[j].local_shape()) * itemsize(g.values[v].meta.dtype, t))
                if v is not None and j < len(outs) and outs[j] is not None:
                    produced[v] = (outs[j], k)
                    made_by[v] = gid
                    if view_of_gathered is not None:
                        gathered[v] = view_of_gathered
            if group is not None:
                group.fwd_comm += seg.fwd_comm - comm_before
            self._saved(seg, name, p, group, kept)
            seg.backward_working_set = max(seg.backward_working_set, cm.backward_working_set(name, p, t))
        return self.segments

    def _saved(self, seg: Segment, name: str, p: Placement, group: Optional[Group],
               kept: Optional[dict[int, float]] = None) -> None:
        entries = self.cm.saved(name, p, self.t, kept)
        target = group.saved if group is not None else seg.act
        for base, nbytes, replicas in entries:
            if self.t.sequence_parallel and name in self.sp_ops and replicas > 1:
                nbytes /= replicas
            target[base] = max(target.get(base, 0.0), nbytes)
            if base in self.core_storage:
                seg.core_act[base] = max(seg.core_act.get(base, 0.0), nbytes)
