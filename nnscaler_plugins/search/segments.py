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
from typing import Callable, Optional, Sequence

import torch

from ..graph import Graph
from ..layout import Layout
from .costmodel import CostModel, Training
from .layouts import Placement


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
    act: dict = field(default_factory=dict)  # storage -> bytes the backward keeps
    core_act: dict = field(default_factory=dict)  # the part of `act` selective recomputation drops
    inputs: dict = field(default_factory=dict)  # values read from other layers -> local bytes (one per copy)
    shared_inputs: dict = field(default_factory=dict)  # values read from non-layer segments (shared by copies)
    # parameters: storage value -> (local elements, devices holding it, gradient partial-group size)
    params: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)  # value -> (local bytes, devices)

    def add(self, other: "Segment", times: int = 1) -> None:
        """Add `times` copies of another segment (identical layers)."""
        self.fwd += times * other.fwd
        self.bwd_input += times * other.bwd_input
        self.bwd_weight += times * other.bwd_weight
        self.fwd_comm += times * other.fwd_comm
        self.bwd_comm += times * other.bwd_comm
        self.flops += times * other.flops
        self.core_fwd += times * other.core_fwd

    @property
    def activations(self) -> float:
        return sum(self.act.values())

    @property
    def core_activations(self) -> float:
        return sum(self.core_act.values())

    @property
    def input_bytes(self) -> float:
        return sum(self.inputs.values())

    def act_bytes(self, recompute: str) -> float:
        """Activations kept per micro-batch under a recomputation choice (full: the segment's inputs
        from other layers; those from outside the layers are counted once per stage by the caller)."""
        if recompute == "full":
            return self.input_bytes
        if recompute == "selective":
            return self.activations - self.core_activations
        return self.activations

    def recompute_time(self, recompute: str) -> tuple[float, float]:
        """(compute, communication) re-run in backward under a recomputation choice."""
        if recompute == "full":
            return self.fwd, self.fwd_comm
        if recompute == "selective":
            return self.core_fwd, 0.0
        return 0.0, 0.0


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
                 layer_segments: Optional[set] = None):
        self.graph, self.cm, self.t = graph, cm, training
        self.segments = [Segment() for _ in range(num_segments)]
        self.to_global = to_global
        self.sp_ops = sp_layers or set()  # ops where sequence parallelism (the plan option) applies
        self.layer_segments = set(range(num_segments)) if layer_segments is None else set(layer_segments)
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
        for op in ops:
            name = op.name
            k = segment_of(name)
            seg = self.segments[k]
            p = placement_of(name)
            c = costs.ops[name]
            shard = p.replicate if (sp and name in self.sp_ops and c.kind == "memory" and not p.splits
                                    and p.replicate > 1) else 1
            ot = cm.op_time(name, p, t, shard)
            seg.fwd += ot.fwd
            seg.bwd_input += ot.bwd_input
            seg.bwd_weight += ot.bwd_weight
            seg.flops += ot.flops * 3 if c.needs_grad else ot.flops
            if c.core:
                seg.core_fwd += ot.fwd
            ins, outs, grads = cm.layouts(name, p)
            for i, v in enumerate(op.inputs):
                val = g.values[v]
                if val.meta is None or ins[i] is None:
                    continue
                need = ins[i]
                isz = itemsize(val.meta.dtype, t)
                needs_grad = val.meta.requires_grad and op.grad_enabled
                if val.kind in ("param", "buffer", "constant"):
                    if v not in storage:
                        lay = Layout(need.shape, need.group, need.replicas * need.partial, 1, need.splits, need.blocks)
                        storage[v] = (lay, k)
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
                if sk != k:
                    if (v, k) not in delivered:
                        delivered.add((v, k))
                        local = math.prod(src.local_shape()) * isz
                        if sk in self.layer_segments:
                            seg.inputs[v] = local
                        else:
                            seg.shared_inputs[v] = local
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
                if grads[i] > 1 and needs_grad:
                    local = math.prod(need.local_shape()) * isz
                    members = sorted(p.devices)[:grads[i]]
                    seg.bwd_comm += cm.all_reduce(local, [self.to_global(d) for d in members])
            for j, v in enumerate(op.outputs):
                if v is not None and j < len(outs) and outs[j] is not None:
                    produced[v] = (outs[j], k)
            self._saved(seg, name, p)
        return self.segments

    def _saved(self, seg: Segment, name: str, p: Placement) -> None:
        entries = self.cm.saved(name, p, self.t)
        for base, nbytes, replicas in entries:
            if self.t.sequence_parallel and name in self.sp_ops and replicas > 1:
                nbytes /= replicas
            seg.act[base] = max(seg.act.get(base, 0.0), nbytes)
            if base in self.core_storage:
                seg.core_act[base] = seg.act[base]
