"""From segment sums to pipeline stages, and from stages to the time and memory of a step.

A stage is a list of segments on one device group. Its forward, backward and weight-gradient task
times, the activations one micro-batch leaves behind, the model states of its devices and the
gradient reduction after its last backward all follow from the segments' sums and the training
choices (`Training`: ZeRO stage, recomputation). `replay_step` runs the stage times through the
plan's schedule with `timeline.replay` (the simulator); `analytic_step` prices the same stages with
the closed forms of docs/cost-model.md (the search's quick screening of many candidates).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from nnscaler_plugins.plan.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    PipelineShape,
    Task,
)
from nnscaler_plugins.plan.timeline import Timeline, replay
from nnscaler_plugins.search.costmodel import BUCKET_BYTES, DTYPE_BYTES, CostModel, Training
from nnscaler_plugins.search.overlap import Overlap
from nnscaler_plugins.search.segments import Segment


@dataclass
class StageCost:
    devices: list[int]  # unit devices of the stage
    F: float = 0.0
    B: float = 0.0
    W: float = 0.0
    compute: float = 0.0  # per micro-batch, forward + backward + recomputation
    comm: float = 0.0  # per micro-batch, synchronous tensor-parallel communication
    flops: float = 0.0
    act: float = 0.0  # activations kept per micro-batch
    transient: float = 0.0  # extra during a backward (the layer rebuilt under full recomputation)
    states: dict = field(default_factory=lambda: {"params": 0.0, "grads": 0.0, "optimizer": 0.0})
    buffers: float = 0.0
    sync: float = 0.0  # gradient reduction (or reduce-scatter) at the end of the last backward
    sync_gather: float = 0.0  # ZeRO-1/2: all-gather of the updated weights (hides under the next forward)
    sync_overlap: bool = True  # the reduction runs in buckets during the last backward
    gather_overlap: bool = True  # the weight all-gather runs during the next step's first forward
    optimizer: float = 0.0  # optimizer step

    @property
    def static(self) -> float:
        return sum(self.states.values()) + self.buffers


@dataclass(frozen=True)
class Part:
    """A segment as part of a stage: `times` identical copies, and how its activations are handled:
    "none" (all kept), "selective" (attention cores recomputed) or "groups" (the segment's recompute
    groups run again in backward)."""

    segment: Segment
    times: int = 1
    recompute: str = "none"


def _param_devices(parts: Sequence[Part], group: Sequence[int]) -> tuple[dict, dict]:
    """Per device of the group: parameter elements held, and gradient-sync groups (members -> elements)."""
    key = (tuple((id(p.segment), p.times) for p in parts), tuple(group))
    hit = _PARAM_CACHE.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[2], (p.segment for p in parts))):
        return hit[0], hit[1]
    out = _param_devices_uncached(parts, group)
    if len(_PARAM_CACHE) > 4096:
        _PARAM_CACHE.clear()
    _PARAM_CACHE[key] = (out[0], out[1], [p.segment for p in parts])
    return out


_PARAM_CACHE: dict = {}  # the same stage contents priced under many ZeRO / recompute choices


def _float8_elements(parts: Sequence[Part], names: frozenset) -> dict[tuple, float]:
    """Of the gradient-sync groups' elements (`_param_devices`' keys), those of the weights `names`
    (ZeRO-3 gathers them in float8)."""
    out: dict[tuple, float] = {}
    for part in parts:
        for v, (local, devices, partition) in part.segment.params.items():
            if v in names:
                key = (tuple(sorted(devices)[:partition]), partition)
                out[key] = out.get(key, 0.0) + local * part.times
    return out


def _param_devices_uncached(parts: Sequence[Part], group: Sequence[int]) -> tuple[dict, dict]:
    elems = {d: 0.0 for d in group}
    sync: dict[tuple, float] = {}
    for part in parts:
        for v, (local, devices, partition) in part.segment.params.items():
            for d in devices:
                if d in elems:
                    elems[d] += local * part.times
            key = (tuple(sorted(devices)[:partition]), partition)
            sync[key] = sync.get(key, 0.0) + local * part.times
    return elems, sync


def compose(cm: CostModel, training: Training, stages: Sequence[Sequence[Part]], devices: Sequence[Sequence[int]],
            dp: int, unit: int, micro_batches: int, split_backward: bool = False,
            to_global: Callable[[int], int] = lambda d: d, overlap: Optional[Overlap] = None) -> list[StageCost]:
    """Stage costs of a pipeline whose stage k holds `stages[k]` on unit devices `devices[k]`;
    `overlap` says what communication hides behind compute (default: the cluster's stack)."""
    t = training
    ov = overlap if overlap is not None else Overlap.of({}, cm.cluster)
    kappa = ov.kappa
    out = []
    for parts, group in zip(stages, devices):
        sc = StageCost(list(group))
        fwd = bwd_in = bwd_w = fcomm = bcomm = rec = rec_comm = flops = 0.0
        act = transient = 0.0
        shared: dict[str, float] = {}
        for part in parts:
            s, n = part.segment, part.times
            fwd += n * s.fwd
            bwd_in += n * s.bwd_input
            bwd_w += n * s.bwd_weight
            fcomm += n * s.fwd_comm
            bcomm += n * s.bwd_comm
            flops += n * s.flops
            rc, rcomm = s.recompute_time(part.recompute)
            rec += n * rc
            rec_comm += n * rcomm
            # a stack that fuses attention cores into flash kernels never stores their score matrices
            fused = cm.cluster.efficiency.fused_attention and cm.cluster.kernels is not None
            kept, kept_shared = s.kept("selective" if fused and part.recompute == "none" else part.recompute)
            act += n * sum(kept.values())
            for k, b in kept_shared.items():
                shared[k] = max(shared.get(k, 0.0), b)
            # during a backward: a rebuilt recompute group, or one op's gradients beside what is held
            transient = max(transient, s.transient(part.recompute), s.backward_working_set)
            for v, (nbytes, devs) in s.buffers.items():
                if group and group[0] in devs:
                    sc.buffers += nbytes * n
        elems, sync = _param_devices(parts, group)
        # Gradients are summed over the pieces of the unit that read a parameter whole times the
        # unit's replicas. ZeRO shards each parameter's states over the replicas of its device only
        # (the runtime's `FlatShard`: `Plan.dp` chunks; nothing to shard with one replica).
        worst = max(group, key=lambda d: elems[d]) if group else 0
        gather = gather_b = sync_time = sync_gather = 0.0
        float8 = _float8_elements(parts, t.fp8_gathered) if t.zero >= 3 and dp > 1 and t.fp8_gathered else {}
        for (members, partition), el in sync.items():
            shard = partition * dp
            if shard <= 1:
                continue
            span = cm.replica_span(members, unit, dp, to_global)
            nbytes = el * t.grad_bytes
            buckets = max(1, math.ceil(nbytes / BUCKET_BYTES))
            if t.zero >= 3 and dp > 1:
                # every micro-batch gathers the weights among the replicas for its forward and its
                # backward and reduce-scatters its gradients among them (a gradient summed over
                # several devices of the unit too is all-reduced whole, then chunked)
                replicas = cm.replica_span(members[:1], unit, dp, to_global)
                f8 = float8.get((members, partition), 0.0)  # weights gathered in float8: 1 byte an element
                ag = cm.net.all_gather((el - f8) * t.param_bytes + f8 * DTYPE_BYTES["fp8"], replicas)
                gather += ag
                gather_b += ag + (cm.net.all_reduce(nbytes, span) if partition > 1
                                  else cm.net.reduce_scatter(nbytes, replicas))
            elif t.zero in (1, 2) and dp > 1:
                # distributed optimizer: reduce-scatter the gradients (in their accumulation dtype), all-gather
                # the updated weights (in theirs: half the bytes of fp32 gradients in bf16 training)
                sync_time += cm.net.reduce_scatter(nbytes, span)
                sync_gather += cm.net.all_gather(el * t.param_bytes, span)
            else:
                sync_time += cm.net.all_reduce(nbytes, span)
            sync_time += (buckets - 1) * (cm.net.alpha_in if span.local else cm.net.alpha_x)
        states = _states(t, parts, worst, dp)
        sc.states = states
        if t.zero >= 3 and dp > 1 and cm.cluster.efficiency.zero3_gather == "module":
            # FSDP's working set: the largest layer's weights whole (and the next one's, prefetched) and its
            # gradients whole before their reduce-scatter
            largest = max((sum(local for local, devices, _ in part.segment.params.values() if worst in devices)
                           for part in parts), default=0.0)
            transient += largest * (2 * t.param_bytes + t.grad_bytes)
        act += sum(shared.values())
        ways = max(1, len(group))
        f = fwd + ov.tp_exposed(fcomm, fwd, ways)
        if ov.tp_comm or not ov.tp_backward:
            b = bwd_in + rec + ov.tp_exposed(bcomm + rec_comm, bwd_in + bwd_w + rec, ways)
        else:  # the backward's collectives beside its weight-gradient matmuls; recomputation's as in forward
            b = bwd_in + rec + rec_comm + ov.hidden_behind(bcomm, bwd_w)
        w = bwd_w
        if gather:
            if kappa is None or not ov.param_gather:  # communication takes the cores compute would use
                f, b = f + gather, b + gather_b
            else:
                # the gathers run beside the pass's compute: what does not fit under it shows, and the
                # overlapped part slows both by kappa (not the whole pass: a short gather under a long
                # pass costs little)
                f = f + ov.hidden_behind(gather, f)
                b = b + ov.hidden_behind(gather_b, b + w)
        if not split_backward:
            b, w = b + w, 0.0
        sc.F, sc.B, sc.W = f, b, w
        sc.compute = fwd + bwd_in + bwd_w + rec
        sc.comm = fcomm + bcomm + rec_comm
        sc.flops = flops
        sc.act, sc.transient = act, transient
        sc.sync = sync_time
        sc.sync_gather = sync_gather
        sc.sync_overlap, sc.gather_overlap = ov.grad_reduce, ov.param_gather
        per_param = t.param_bytes * 2 + t.grad_bytes + (t.master_bytes + t.optimizer_bytes) * 2
        opt_elems = sc.states["optimizer"] / max(1, t.master_bytes + t.optimizer_bytes)
        sc.optimizer = opt_elems * per_param / cm.streaming_rate
        out.append(sc)
    return out


def _states(t: Training, parts: Sequence[Part], device: int, dp: int) -> dict:
    # the device's parameter elements, their states sharded by ZeRO over the unit's replicas
    el = 0.0
    for part in parts:
        for v, (local, devices, partition) in part.segment.params.items():
            if device in devices:
                el += local * part.times
    return dict(t.state_bytes(el, dp)) if el else {"params": 0.0, "grads": 0.0, "optimizer": 0.0}


@dataclass
class Step:
    time: float
    compute: float
    comm: float
    bubble: float
    act_peak: list[float]  # per stage: activations at the worst moment (incl. transient)
    act_held: list[float]  # per stage: activations held at that moment (without transient)
    exposed_sync: list[float]
    timeline: Optional[Timeline] = None


def _rank_stages(stage_rank: Sequence[int]) -> list[list[int]]:
    ranks = max(stage_rank) + 1
    return [[k for k, r in enumerate(stage_rank) if r == rank] for rank in range(ranks)]


def overlap_factor(cluster) -> Optional[float]:
    """Galvatron's kappa for overlapped compute and communication, or None where they cannot overlap
    (processes on CPU cores run their collectives on the same cores)."""
    eff = cluster.efficiency
    return eff.overlap_slowdown if eff.comm_overlap else None


@dataclass(frozen=True)
class ChunkTimes:
    """When a rank's model chunk (one stage of it) runs its last backward and its first forward in the
    replayed step: its gradients are reduced from the start of that backward on (buckets launched as
    they fill) and its weights must be gathered again before that forward of the next step."""

    last_backward_start: float
    last_backward_end: float
    first_forward_start: float


def _sync_exposed(stages: list[StageCost], ks: list[int], end: float, kappa: float,
                  chunks: dict[int, ChunkTimes]) -> float:
    """Time the gradient reductions of a rank's chunks add after its last task: each chunk's reduction
    starts with its last backward (Megatron's overlap-grad-reduce launches a chunk's buckets there; an
    interleaved rank's later chunks finish their backwards while the earlier ones still compute), the
    reductions queue on the network one after another, and what runs beside compute slows it by kappa."""
    free = 0.0
    total = 0.0
    for k in sorted(ks, key=lambda k: chunks[k].last_backward_start):
        sync = stages[k].sync
        if sync <= 0:
            continue
        free = max(free, chunks[k].last_backward_start) + sync
        total += sync
    shown = max(0.0, free - end)
    return shown + (kappa - 1.0) * (total - shown)


def _gather_exposed(stages: list[StageCost], ks: list[int], kappa: float, chunks: dict[int, ChunkTimes]) -> float:
    """Delay of the next step's first forwards waiting for the weights all-gathered after the optimizer
    step (ZeRO-1/2 with overlap-param-gather): chunk by chunk in the order of their first forwards, each
    needed by the end of its chunk's first forward (the gather runs ahead bucket by bucket)."""
    free = delay = total = 0.0
    for k in sorted(ks, key=lambda k: chunks[k].first_forward_start):
        gather = stages[k].sync_gather
        if gather <= 0:
            continue
        free += gather
        total += gather
        delay = max(delay, free - (chunks[k].first_forward_start + stages[k].F))
    return delay + (kappa - 1.0) * (total - delay)


def _finish(stages: list[StageCost], rank_stages: list[list[int]], ends: list[float], kappa: Optional[float],
            last_b: list[float], m: int, chunks: Optional[list[dict[int, ChunkTimes]]] = None
            ) -> tuple[float, list[float], list[float], list[float]]:
    """Step time and per-rank figures from the ranks' ends: gradient reduction and weight gathers after
    the last tasks (overlapped as the stages allow), the optimizer step. `chunks`: each rank's chunk
    times from a replayed timeline (the simulator); without them, the closed forms' window of one last
    backward and one first forward (the search's screening)."""
    total, exposed, computes, comms = [], [], [], []
    for rank, ks in enumerate(rank_stages):
        sync = sum(stages[k].sync for k in ks)
        window = last_b[rank]
        overlapped = kappa is not None and all(stages[k].sync_overlap for k in ks)
        if overlapped and chunks is not None:
            extra = _sync_exposed(stages, ks, ends[rank], kappa, chunks[rank])
        else:
            extra = max(0.0, sync - window) + (kappa - 1.0) * min(sync, window) if overlapped else sync
        gather = sum(stages[k].sync_gather for k in ks)
        if gather:
            first_f = sum(stages[k].F for k in ks)
            if kappa is not None and all(stages[k].gather_overlap for k in ks):
                extra += _gather_exposed(stages, ks, kappa, chunks[rank]) if chunks is not None else \
                    max(0.0, gather - first_f) + (kappa - 1.0) * min(gather, first_f)
            else:
                extra += gather
        opt = max((stages[k].optimizer for k in ks), default=0.0)
        total.append(ends[rank] + extra + opt)
        exposed.append(extra)
        computes.append(sum(stages[k].compute for k in ks) * m + opt)
        comms.append(sum(stages[k].comm for k in ks) * m + extra)
    return max(total), exposed, computes, comms


def replay_step(stages: list[StageCost], lists: list[list[Task]], shape: PipelineShape,
                transfer: Callable[[int, int, bool], float], kappa: Optional[float], keep: bool = False) -> Step:
    """The step through the schedule's own task lists (the simulator)."""
    cache: dict = {}

    def duration(rank: int, task: Task) -> float:
        s = stages[task.stage]
        return s.F if task.kind == FORWARD else s.B if task.kind == BACKWARD else s.W

    def xfer(src: Task, dst: Task) -> float:
        key = (src.stage, dst.stage, src.kind)
        x = cache.get(key)
        if x is None:
            x = cache[key] = transfer(src.stage, dst.stage, src.kind != FORWARD)
        return x

    tl = replay(lists, shape, duration, xfer)
    rank_stages = _rank_stages(shape.stage_rank)
    ends, last_b, chunks = [], [], []
    for rank, events in enumerate(tl.events):
        ends.append(events[-1].end if events else 0.0)
        lb = next((e for e in reversed(events) if e.task.kind != FORWARD), None)
        last_b.append(lb.end - lb.start if lb is not None else 0.0)
        times: dict[int, ChunkTimes] = {}
        for k in rank_stages[rank]:
            back = [e for e in events if e.task.stage == k and e.task.kind != FORWARD]
            fwd = next((e for e in events if e.task.stage == k and e.task.kind == FORWARD), None)
            times[k] = ChunkTimes(back[-1].start if back else 0.0, back[-1].end if back else 0.0,
                                  fwd.start if fwd is not None else 0.0)
        chunks.append(times)
    time, exposed, computes, comms = _finish(stages, rank_stages, ends, kappa, last_b, shape.micro_batches, chunks)
    release = WEIGHT if shape.split_backward else BACKWARD
    peaks, helds = [0.0] * len(stages), [0.0] * len(stages)
    for rank, events in enumerate(tl.events):
        held = peak = held_at = 0.0
        for e in events:
            s = stages[e.task.stage]
            if e.task.kind == FORWARD and e.task.grad:
                held += s.act
                if held > peak:
                    peak, held_at = held, held
            elif e.task.kind in (BACKWARD, WEIGHT):
                cand = held + (s.transient if e.task.kind == BACKWARD else 0.0)
                if cand > peak:
                    peak, held_at = cand, held
                if e.task.kind == release:
                    held -= s.act
        for k in rank_stages[rank]:
            peaks[k], helds[k] = peak, held_at
    worst = max(range(len(computes)), key=lambda r: computes[r] + comms[r])
    bubble = sum(tl.bubble) / len(tl.bubble) if tl.bubble else 0.0
    return Step(time, computes[worst], comms[worst], bubble, peaks, helds, exposed, tl if keep else None)


def analytic_step(stages: list[StageCost], schedule: str, ranks: int, virtual: int, m: int,
                  transfer: Callable[[int, int, bool], float], kappa: Optional[float]) -> Step:
    """Closed forms (Megatron, Alpa, zero-bubble) for the same stages: the search's screening."""
    rank_stages = _rank_stages([k % ranks for k in range(len(stages))]) if len(stages) > 1 else [[0]]
    per_rank = [(sum(stages[k].F for k in ks), sum(stages[k].B for k in ks), sum(stages[k].W for k in ks))
                for ks in rank_stages]
    c = max((transfer(k, k + 1, False) for k in range(len(stages) - 1)), default=0.0)
    slow = max(f + b + w for f, b, w in per_rank)
    p = ranks
    if p == 1:
        makespan = m * slow
    elif schedule == "gpipe" or schedule == "1f1b":
        # Alpa: sum of the stages plus (m - 1) times the slowest, plus the transfers on the way
        makespan = sum(f + b + w for f, b, w in per_rank) + (m - 1) * (slow + (2 * c if schedule == "1f1b" else 0)) \
            + 2 * (p - 1) * c
    elif schedule == "interleaved":
        makespan = (m + (p - 1) / virtual) * slow + 2 * (p - 1) * c + (m - 1) * 2 * c
    elif schedule == "zero-bubble":
        fb = max(f + b for f, b, _ in per_rank)
        makespan = m * slow + (p - 1) * fb / 3 + 2 * (p - 1) * c + (m - 1) * 2 * c
    else:
        makespan = (m + p - 1) * slow
    ends = [makespan] * len(rank_stages)
    last_b = [b + w for _, b, w in per_rank]
    time, exposed, computes, comms = _finish(stages, rank_stages, ends, kappa, last_b, m)
    peaks, helds = [], []
    for k, st in enumerate(stages):
        rank = k % ranks
        per_mb = sum(stages[j].act for j in rank_stages[rank])  # all chunks of the rank, one micro-batch
        if p == 1:
            held = per_mb
        elif schedule == "gpipe":
            held = per_mb * m
        elif schedule == "interleaved" and virtual > 1:
            # Megatron's warm-up: (p - r - 1) * 2 + (v - 1) * p chunk forwards before the first backward
            chunks = min((p - rank - 1) * 2 + (virtual - 1) * p + 1, m * virtual)
            held = per_mb / virtual * chunks
        else:
            held = per_mb * min(m, p - rank)
        peaks.append(held + st.transient)
        helds.append(held)
    worst = max(range(len(computes)), key=lambda r: computes[r] + comms[r])
    bubble = max(0.0, makespan - slow * m)
    return Step(time, computes[worst], comms[worst], bubble, peaks, helds, exposed)
