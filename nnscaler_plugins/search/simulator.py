"""The simulator: a plan's training step replayed as an event timeline with cost-model durations.

`simulate(plan, cluster)` reads every op's placement, prices it with the cost model, sums the pieces
into per-stage forward (F), backward (B) and weight-gradient (W) task times, and replays the plan's
own per-rank task lists through `timeline.replay` (the same replay that dry-runs schedules and
draws the rendered timeline), with stage-to-stage transfers on the links the stages sit on. A plan
without a pipeline is one stage that runs its micro-batches one after another. After the last
backward each rank reduces its gradients (overlapped with that backward, as the bucketed reducer
does) and steps the optimizer.

Memory per device: weights, gradients and optimizer states of the parameters the device holds (per
ZeRO stage over its data-parallel group), plus the activations held at the worst moment of the
timeline (each forward adds its stage's activations for one micro-batch, its backward frees them),
plus, under full recomputation, the largest layer rebuilt during a backward.

The simulator never touches torch.distributed: everything is arithmetic on the graph and the plan.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.float8 import all_gather_in_float8, float8_linears, float8_weights
from nnscaler_plugins.plan.layers import layer_groups
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.schedules import BACKWARD, FORWARD, PipelineShape, Task
from nnscaler_plugins.plan.timeline import Timeline
from nnscaler_plugins.search.cluster import ClusterSpec, GiB
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.opcost import ATTENTION, MATMUL
from nnscaler_plugins.search.offload_cost import apply_offload
from nnscaler_plugins.search.overlap import Overlap, not_run_as_priced
from nnscaler_plugins.search.segments import Walker
from nnscaler_plugins.search.stages import (
    Part,
    StageCost,
    Step,
    compose,
    overlap_factor,
    replay_step,
)


@dataclass
class Estimate:
    """What one training step of a plan costs on a cluster.

    Times are seconds for one step (all micro-batches of every replica, in parallel). `compute_s`
    and `communication_s` are those of the busiest device; `bubble_s` is the mean idle time of the
    pipeline ranks inside the step. `peak_memory_bytes[d]` is the peak of unit device d (every
    data-parallel replica of the unit has the same); `memory` breaks down the largest one.
    """

    step_time_s: float
    compute_s: float
    communication_s: float
    bubble_s: float
    peak_memory_bytes: list[float]
    memory: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 1
    world_size: int = 1
    flops_per_device: float = 0.0  # model FLOPs of one step per device (forward + backward, no recompute)
    cluster: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    timeline: Optional[Timeline] = field(default=None, repr=False, compare=False)

    @property
    def max_memory_bytes(self) -> float:
        return max(self.peak_memory_bytes, default=0.0)

    @property
    def peak_memory_gib(self) -> float:
        return self.max_memory_bytes / GiB

    def tflops_per_device(self) -> float:
        return self.flops_per_device / self.step_time_s / 1e12 if self.step_time_s else 0.0

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "communication_s": self.communication_s, "bubble_s": self.bubble_s,
                "peak_memory_bytes": [float(x) for x in self.peak_memory_bytes],
                "max_memory_bytes": self.max_memory_bytes, "memory": dict(self.memory),
                "micro_batches": self.micro_batches, "world_size": self.world_size,
                "flops_per_device": self.flops_per_device, "cluster": self.cluster, "details": dict(self.details)}

    @classmethod
    def from_json(cls, d: dict) -> "Estimate":
        return cls(float(d["step_time_s"]), float(d.get("compute_s", 0.0)), float(d.get("communication_s", 0.0)),
                   float(d.get("bubble_s", 0.0)), [float(x) for x in d.get("peak_memory_bytes", [])],
                   dict(d.get("memory", {})), int(d.get("micro_batches", 1)), int(d.get("world_size", 1)),
                   float(d.get("flops_per_device", 0.0)), str(d.get("cluster", "")), dict(d.get("details", {})))

    def describe(self) -> str:
        mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.memory.items())
        return (f"step {self.step_time_s:.4g} s (compute {self.compute_s:.4g} s, communication "
                f"{self.communication_s:.4g} s, bubble {self.bubble_s:.4g} s); peak memory "
                f"{self.peak_memory_gib:.2f} GiB per device ({mem} GiB)")


def parts_of(graph: Graph) -> tuple[dict[str, tuple], list[list]]:
    """Each op's part of the model ("pre", ("layer", i), "post"), and the layers' ops.

    Layers are what full recomputation rebuilds; a model without repeated blocks is one such part."""
    groups = layer_groups(graph)
    if not groups.layers:
        return {op.name: ("layer", 0) for op in graph.ops}, [list(graph.ops)]
    part = {op.name: "pre" for op in groups.pre}
    part.update({op.name: "post" for op in groups.post})
    for i, ops in enumerate(groups.layers):
        for op in ops:
            part[op.name] = ("layer", i)
    return part, groups.layers


def simulate(plan: Plan, cluster: ClusterSpec, graph: Optional[Graph] = None, *,
             cost_model: Optional[CostModel] = None, keep_timeline: bool = False) -> Estimate:
    """Replay one training step of `plan` on `cluster` and return its `Estimate`.

    `graph` is the graph the plan was made for; plans from `nns.plan`, `nns.search` and
    `PlanBuilder.finish` remember theirs, so it is only needed for plans loaded from a file.
    """
    graph = graph if graph is not None else getattr(plan, "graph", None)
    if graph is None:
        raise PlanError("simulate needs the graph the plan was made for: pass graph= (nns.capture of the model "
                        "with one micro-batch of inputs); plans loaded from JSON do not carry their graph")
    if plan.graph_fingerprint != graph.fingerprint():
        raise PlanError(f"the plan was made for graph {plan.graph_fingerprint}, not for this graph "
                        f"{graph.fingerprint()} ({graph.model_class}); simulate it with the graph it was made for")
    if plan.world_size > cluster.num_devices:
        raise PlanError(f"the plan needs {plan.world_size} devices but cluster {cluster.name!r} has "
                        f"{cluster.num_devices} ({cluster.nodes} node(s) x {cluster.devices_per_node}); "
                        f"use nns.cluster({cluster.name!r}, nodes={-(-plan.world_size // cluster.devices_per_node)})")
    cm = cost_model if cost_model is not None and cost_model.graph is graph and cost_model.cluster == cluster \
        else CostModel(graph, cluster)
    return replay_plan(plan, cluster, graph, cm, keep_timeline)


def priced_settings(plan: Plan) -> dict:
    """What the cost model prices a plan with, from its typed fields and knobs: precision, ZeRO stage,
    recompute mode, sequence parallelism, cp_comm and the overlap switches (None: the cluster's)."""
    k = plan.knobs
    return {"precision": plan.precision, "zero": plan.zero, "recompute": k.recompute,
            "sequence_parallel": k.sequence_parallel, "cp_comm": k.cp_comm, "tp_comm_overlap": k.tp_comm_overlap,
            "overlap_grad_reduce": k.overlap_grad_reduce, "overlap_param_gather": k.overlap_param_gather,
            "overlap_p2p": k.overlap_p2p, "compile": k.compile}


def op_checkpoint_policy(graph: Graph, part: Mapping[str, Any]) -> Callable[[str], bool]:
    """torchtitan's per-op selective activation checkpointing, as a predicate on ops: inside each layer
    the outputs of the 1st, 3rd, 5th, ... matmul with a weight operand and of attention kernels are kept;
    everything else is recomputed in backward (its `_save_list` and "every second mm" rule)."""
    keep: set = set()
    count: dict[Any, int] = {}
    for op in graph.ops:
        layer = part.get(op.name)
        if not isinstance(layer, tuple):
            continue
        name = op.short_name
        if name in ATTENTION:
            keep.add(op.name)
        elif name in MATMUL and any(graph.values[v].kind == "param" for v in op.inputs):
            count[layer] = count.get(layer, 0) + 1
            if count[layer] % 2 == 1:
                keep.add(op.name)
    return keep.__contains__


def training_of(plan: Plan, cluster: ClusterSpec) -> Training:
    """How `plan` trains, as the cost model prices it: from the fields the runtime reads.

    Precision is the plan's own (`Plan.precision`) when the plan chose one: a precision other than
    fp32, or a plan the search made for a cluster (`knobs.cluster`), priced in the precision it
    records. Otherwise, for plans that never chose one, the cluster's training dtype. The ZeRO stage
    is `Plan.zero`; recomputation comes from the plan's recompute groups (see `replay_plan`) or its
    recompute knob. `sequence_parallel` is what the plan declares; the sequence splits themselves
    are priced from its placements."""
    opts = priced_settings(plan)
    if plan.knobs.cluster is None and plan.precision == "fp32":
        del opts["precision"]
    training = Training.from_options(opts, cluster)
    if cluster.efficiency.main_grad_bytes:  # a published run's stack that keeps its gradients narrower
        training = dataclasses.replace(training, grad_bytes=cluster.efficiency.main_grad_bytes)
    return training


def replay_plan(plan: Plan, cluster: ClusterSpec, graph: Graph, cm: CostModel, keep_timeline: bool = False) -> Estimate:
    """`simulate` without its checks, for callers that made the plan for this graph themselves."""
    training = training_of(plan, cluster)
    if plan.precision == "fp8":
        training = dataclasses.replace(training, fp8_ops=frozenset(float8_linears(graph, plan.knobs)))
    if all_gather_in_float8(plan.precision, plan.zero, plan.dp, plan.knobs):  # priced as the runtime gathers
        training = dataclasses.replace(training, fp8_gathered=frozenset(float8_weights(graph, plan.knobs)))
    m = plan.num_micro_batches
    if plan.pipeline is None:
        stage_of = {op.name: 0 for op in graph.ops}
        stage_devices = [list(range(plan.unit_size))]
    else:
        stage_of = {op.name: int(plan.ops[op.name].stage or 0) for op in graph.ops}
        stage_devices = [list(g) for g in plan.pipeline.stage_devices]
    part, _ = parts_of(graph)
    seg_index: dict[tuple, int] = {}
    for op in graph.ops:
        seg_index.setdefault((stage_of[op.name], part[op.name]), len(seg_index))
    seg_stage = {i: key[0] for key, i in seg_index.items()}
    seg_layer = {i: key[1] != "pre" and key[1] != "post" for key, i in seg_index.items()}
    # A plan is priced as its placements say: sequence parallelism is the sequence splits it carries
    # (the `megatron` strategy's and the search's plans have them), never a discount on ops it runs
    # whole. (`Walker(sp_layers=...)` keeps that what-if for the cost model's own formulas.)
    sp_ops: set = set()
    # recomputation: the plan's recompute groups when it has them; otherwise its "recompute" option
    # (full: every layer one group; selective: the attention cores)
    groups = {name: p.recompute for name, p in plan.ops.items() if getattr(p, "recompute", None) is not None}
    keep_output = None
    if groups:
        group_of, mode = groups.get, "groups"
    elif training.recompute in ("full", "op"):
        group_of = lambda n: part[n] if part[n] not in ("pre", "post") else None  # noqa: E731
        mode = "groups"
        if training.recompute == "op":
            keep_output = op_checkpoint_policy(graph, part)
    else:
        group_of, mode = (lambda n: None), training.recompute
    walker = Walker(graph, cm, training, len(seg_index), sp_layers=sp_ops,
                    layer_segments={i for i, layer in seg_layer.items() if layer}, group_of=group_of,
                    cp_comm=plan.knobs.cp_comm, keep_output=keep_output)
    placements = {name: Placement.of(p) for name, p in plan.ops.items()}
    segments = walker.run(graph.ops, placements.__getitem__, lambda n: seg_index[(stage_of[n], part[n])],
                          lambda a, b: seg_stage[a] != seg_stage[b])
    per_stage: list[list[Part]] = [[] for _ in stage_devices]
    for i, seg in enumerate(segments):
        per_stage[seg_stage[i]].append(Part(seg, 1, mode))
    split = plan.pipeline is not None and plan.pipeline.split_backward
    overlap = Overlap.of(priced_settings(plan), cluster)
    stages = compose(cm, training, per_stage, stage_devices, plan.dp, plan.unit_size, m, split, overlap=overlap)
    boundary: dict[tuple[int, int], float] = {}
    boundary_grad: dict[tuple[int, int], float] = {}
    for (a, b), x in walker.boundary.items():
        key = (seg_stage[a], seg_stage[b])
        boundary[key] = boundary.get(key, 0.0) + x
    for (a, b), x in walker.boundary_grad.items():
        key = (seg_stage[a], seg_stage[b])
        boundary_grad[key] = boundary_grad.get(key, 0.0) + x
    transfer = Transfers(cm, stage_devices, boundary, boundary_grad)
    if not overlap.p2p:
        # blocking sends: the sender waits for each transfer too (the receiver always does)
        for k in range(len(stages)):
            for j in range(len(stages)):
                if j != k and (min(j, k), max(j, k)) in boundary:
                    if j > k:
                        stages[k].F += transfer(k, j, False)
                    else:
                        stages[k].B += transfer(k, j, True)
    if plan.pipeline is not None:
        lists, shape = plan.pipeline.task_lists(), plan.pipeline.shape()
    else:
        shape = PipelineShape(1, 1, m)
        lists = [[task for mb in range(m) for task in (Task(0, mb, FORWARD), Task(0, mb, BACKWARD))]]
    step = replay_step(stages, lists, shape, transfer, overlap_factor(cluster), keep_timeline)
    est = estimate_of(plan, cluster, training, stages, step, m)
    missing = not_run_as_priced(priced_settings(plan), cluster, training.zero, any(s.comm > 0 for s in stages))
    if training.recompute == "op" and not groups:
        missing.append("recompute='op' (per-op selective checkpointing)")
    if missing:
        est.details["not_run_as_priced"] = missing
    return est


def optimizer_step_bytes(cluster: ClusterSpec, training: Training, optimizer_state_bytes: float) -> float:
    """Working memory of the optimizer step beside the model states, for a device whose optimizer
    states take `optimizer_state_bytes`: a stack that accumulates gradients in bf16
    (`Efficiency.main_grad_bytes` 2) copies each gradient of its optimizer shard to fp32 for the update
    (Megatron-Core's distributed optimizer: `shard_main_param.grad = shard_model_grad.float()`), 4 bytes
    per element of the shard. This runtime's gradients are fp32 already: nothing."""
    grad_bytes = cluster.efficiency.main_grad_bytes
    if not 0 < grad_bytes < 4:
        return 0.0
    elements = optimizer_state_bytes / max(1, training.master_bytes + training.optimizer_bytes)
    return elements * 4


class Transfers:
    """Time to move the values crossing from one stage to another (one micro-batch), on the links
    the two device groups sit on; with equal groups each sender sends 1/t and the receivers gather
    (Megatron's scatter/gather), otherwise whole tensors go from senders taken in turn."""

    def __init__(self, cm: CostModel, stage_devices: list[list[int]], boundary: dict, boundary_grad: dict,
                 to_global=lambda d: d):
        self.cm, self.devices, self.to_global = cm, stage_devices, to_global
        self.boundary, self.boundary_grad = boundary, boundary_grad

    def __call__(self, src: int, dst: int, grad: bool) -> float:
        table = self.boundary_grad if grad else self.boundary
        lo, hi = min(src, dst), max(src, dst)
        nbytes = sum(x for (a, b), x in table.items() if a <= lo and b >= hi)
        if nbytes <= 0:
            return 0.0
        sdev, ddev = self.devices[src], self.devices[dst]
        dpn = self.cm.cluster.devices_per_node
        cross = len({self.to_global(d) // dpn for d in list(sdev) + list(ddev)}) > 1
        net = self.cm.net
        if len(sdev) == len(ddev) and len(sdev) > 1:
            inner = net.all_gather(nbytes, self.cm.span([self.to_global(d) for d in ddev]))
            return net.p2p(nbytes / len(sdev), cross) + inner
        per_sender = math.ceil(len(ddev) / max(1, len(sdev)))
        return net.p2p(nbytes * per_sender, cross)


def estimate_of(plan: Plan, cluster: ClusterSpec, training: Training, stages: list[StageCost], step: Step,
                m: int) -> Estimate:
    """Per-device memory and the step's figures as an `Estimate`.

    A device holds the model states of every stage it runs (all chunks of an interleaved rank) and,
    at its worst moment, the activations its rank holds then (`step.act_peak`, per stage of that rank),
    or, at the optimizer step, when the activations are gone, the step's own working memory
    (`optimizer_step_bytes`)."""
    static = [{"params": 0.0, "grads": 0.0, "optimizer": 0.0, "buffers": 0.0} for _ in range(plan.unit_size)]
    act = [0.0] * plan.unit_size
    held = [0.0] * plan.unit_size
    stepping = [0.0] * plan.unit_size
    for k, st in enumerate(stages):
        for d in st.devices:
            for key in ("params", "grads", "optimizer"):
                static[d][key] += st.states[key]
            static[d]["buffers"] += st.buffers
            if step.act_peak[k] >= act[d]:
                act[d], held[d] = step.act_peak[k], step.act_held[k]
            if not plan.offload:  # offloaded, the step runs on the host
                stepping[d] += optimizer_step_bytes(cluster, training, st.states["optimizer"])
    offload_s, offloaded = apply_offload(plan, cluster, training, static, [max(
        (s.optimizer for s in stages if d in s.devices), default=0.0) for d in range(plan.unit_size)], m)
    peaks = [sum(static[d].values()) + max(act[d], stepping[d]) for d in range(plan.unit_size)]
    worst = max(range(plan.unit_size), key=lambda d: peaks[d]) if peaks else 0
    if peaks and stepping[worst] > act[worst]:
        breakdown = dict(static[worst], activations=0.0, transient=0.0, optimizer_step=stepping[worst])
    else:
        breakdown = dict(static[worst], activations=held[worst], transient=act[worst] - held[worst]) if peaks else {}
    flops = max((sum(s.flops for s in stages if s.devices == st_.devices) for st_ in stages), default=0.0) * m
    details = {"stage_fwd_s": [s.F for s in stages], "stage_bwd_s": [s.B for s in stages],
               "stage_wgrad_s": [s.W for s in stages], "exposed_grad_sync_s": step.exposed_sync,
               "optimizer_s": max((s.optimizer for s in stages), default=0.0),
               "training": training.to_json(),
               # model states (params, gradients, optimizer) of each device of the unit, bytes
               "states_per_device": [static[d]["params"] + static[d]["grads"] + static[d]["optimizer"]
                                     for d in range(plan.unit_size)],
               # the unit's devices of each stage (chunk) in pipeline order: where a figure of one rank
               # (the last stage's peak, the first stage's) is read from
               "stage_devices": [list(s.devices) for s in stages]}
    if plan.offload:
        details["offload"] = offloaded[worst].to_json()
    return Estimate(step_time_s=step.time + offload_s, compute_s=step.compute, communication_s=step.comm,
                    bubble_s=step.bubble,
                    peak_memory_bytes=peaks, memory=breakdown, micro_batches=m, world_size=plan.world_size,
                    flops_per_device=flops, cluster=cluster.name, details=details, timeline=step.timeline)


