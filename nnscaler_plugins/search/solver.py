"""The search: intra-op choices per device group, inter-op choices around them, a Pareto set of plans.

    plans = nns.search(graph, world_size=64, cluster=nns.cluster("a100-dgx", nodes=8), global_batch_size=512)
    best = plans.best                       # fastest plan that fits the memory limit
    print(plans.table()); best.save("plan.json")

1. For every device-group size a stage may have (and, when data parallelism lives inside the unit,
   every way to see the group as a 2-D mesh), the intra-op search (`intraop`) solves which label of
   each op to split. Identical layers are solved once.
2. Around each of those, the inter-op choices are enumerated: pipeline ranks and stage boundaries
   (layers cut so that stages take equal time, the ops before the layers in the first stage and the
   ops after them in the last), data-parallel replicas, micro-batches, schedule (1F1B, GPipe,
   interleaved with 2-4 chunks, zero-bubble), ZeRO stage and recomputation. Constraints prune
   configurations and op choices as they are generated. Each candidate's stages are priced from the
   solved segments with closed-form pipeline times (`stages.analytic_step`).
3. The candidates near the (time, memory) frontier are made into real plans with the primitives
   (op_trans, op_assign, op_order), simulated in full (`simulator.simulate`, which replays the
   schedule's task lists), and the non-dominated ones that fit the memory limit are returned.

Everything is deterministic: candidates are generated and sorted in a fixed order, ties broken by
their description. Two data-parallel modes exist: `unit` puts data parallelism inside the plan's
unit (every op split along its batch label; the graph is one micro-batch of the whole step, every
replica's rows together), which is what `strategy="auto"` in `nns.plan` needs because there the
unit is the whole world; the default puts it in the plan's replicas (`Plan.dp`; the graph is one
micro-batch of one replica).

What is priced is what runs: every op choice the search considers is one the op's rule can execute
(its `localize`, which lowering calls, accepts the split), the plans carry the precision they were
priced in (`Plan.precision`; the cluster's training dtype unless `precision=` says otherwise), the
ZeRO stage (`Plan.zero`), recompute groups for exactly the ops the cost model recomputed, and, for
sequence-parallel candidates, the sequence splits that were priced.
"""
from __future__ import annotations

import bisect
import dataclasses
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.knobs import Knobs
from nnscaler_plugins.plan.float8 import float8_linears, float8_weights
from nnscaler_plugins.plan.plan import PRECISIONS, Plan
from nnscaler_plugins.search.cluster import PRESETS, ClusterSpec
from nnscaler_plugins.search.cluster import cluster as make_cluster
from nnscaler_plugins.search.constraints import (
    Constraint,
    HFTensorParallelPlan,
    MaxTensorParallel,
    MemoryLimit,
    MicroBatchSize,
    parse_bytes,
)
from nnscaler_plugins.search.costmodel import CostModel, Training, compiles_faster, supports_fp8
from nnscaler_plugins.search.dims import batch_size
from nnscaler_plugins.search.group_kernels import kind_of
from nnscaler_plugins.search.intraop import IntraResult, IntraSolver
from nnscaler_plugins.search.pareto import ParetoSet, frontier
from nnscaler_plugins.search.progress import Progress
from nnscaler_plugins.search.replication import PARALLEL
from nnscaler_plugins.search.segments import Segment
from nnscaler_plugins.search.simulator import Estimate, replay_plan
from nnscaler_plugins.search.space import RECOMPUTE, Config, divisors, mesh_of_config, meshes
from nnscaler_plugins.search.stages import Part, analytic_step, compose, overlap_factor

GiB = 1024 ** 3
LONG_SEQUENCE = 8192  # attention this long or longer: context parallelism is searched by default


class SearchError(PlanError):
    """No plan satisfies the constraints; the message names the binding one."""


@dataclass
class Candidate:
    cfg: Config
    intra: IntraResult
    bounds: list[int]  # layer index where each stage starts (plus the end)
    time: float
    memory: float
    graph: Graph = field(repr=False)

    def describe(self) -> str:
        return f"{self.cfg.describe()} [{self.intra.seed}]"


def _stage_bounds(weights: Sequence[float], stages: int) -> Optional[list[int]]:
    """Cut len(weights) layers into `stages` contiguous runs whose heaviest run is as light as possible.

    The pipeline's step is paced by its slowest stage, so the cut minimizes the largest stage weight
    (the first and last layers carry the embedding and the head); a proportional cut can leave one
    stage a whole layer heavier than needed, which at two layers per stage costs half the step."""
    key = (tuple(weights), stages)
    hit = _BOUNDS_CACHE.get(key)
    if hit is None and key not in _BOUNDS_CACHE:
        hit = _BOUNDS_CACHE[key] = _minimax_cut(list(weights), stages)
    return None if hit is None else list(hit)


_BOUNDS_CACHE: dict[tuple, Optional[list[int]]] = {}


def _minimax_cut(w: list[float], stages: int) -> Optional[list[int]]:
    n = len(w)
    if stages > n or stages < 1:
        return None
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def cut(limit: float) -> Optional[list[int]]:
        cuts, pos = [0], 0
        for k in range(stages):
            left = stages - k - 1  # stages after this one, each needs a layer
            j = bisect.bisect_right(prefix, prefix[pos] + limit, lo=pos + 1) - 1
            j = min(j, n - left)
            if j <= pos:
                return None
            pos = j
            cuts.append(pos)
        return cuts if pos == n else None

    lo, hi = max(w), prefix[-1]
    best = cut(hi)
    for _ in range(40):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        c = cut(mid)
        if c is None:
            lo = mid
        else:
            hi, best = mid, c
    return best


def _runs(segments: Sequence[Segment], mode: str) -> list[Part]:
    """Consecutive identical segment objects as one Part with a count."""
    out: list[Part] = []
    for s in segments:
        if out and out[-1].segment is s:
            out[-1] = Part(s, out[-1].times + 1, mode)
        else:
            out.append(Part(s, 1, mode))
    return out


MODE = {"none": "none", "selective": "selective", "full": "groups"}


class Search:
    def __init__(self, graphs: dict[int, Graph], world_size: int, cluster: ClusterSpec, constraints: Sequence,
                 global_batch_size: Optional[int], memory_limit: Optional[float], progress: bool,
                 unit_mode: bool = False, micro_batches: Optional[int] = None, max_simulated: int = 8,
                 max_group: Optional[int] = None, schedules: Sequence[str] = ("1f1b", "gpipe", "interleaved",
                                                                               "zero-bubble"),
                 sequence_parallel: bool = False, precision: Optional[str] = None,
                 context_parallel: Optional[bool] = None, compile: Optional[bool] = False):
        self.graphs = graphs
        self.compile = compile  # True: priced and run compiled; None: chosen per plan where it is faster
        self._fp8_ops: Optional[frozenset] = None
        self._fp8_gathered: frozenset = frozenset()
        self.context_parallel = context_parallel
        self.world = int(world_size)
        self.cluster = cluster
        self.dtype = _precision(precision, cluster)
        self.unit_mode = unit_mode
        self.fixed_m = micro_batches
        self.max_simulated = max_simulated
        self.schedules = tuple(schedules)
        self.sequence_parallel = sequence_parallel
        cons = []
        hf = None
        for c in constraints:
            if isinstance(c, MaxTensorParallel) and c.limit is None:
                c = c.bind(cluster)
            if isinstance(c, MemoryLimit):
                memory_limit = min(memory_limit, c.limit) if memory_limit is not None else c.limit
            if isinstance(c, HFTensorParallelPlan):
                hf = c
            cons.append(c)
        self.constraints = cons
        self.hf = hf
        self.memory_limit = float(memory_limit) if memory_limit is not None else float(cluster.memory_bytes)
        self.memory_from_user = memory_limit is not None
        self.global_batch = int(global_batch_size) if global_batch_size is not None else None
        self.progress = Progress("nnscaler search", 1, enabled=progress)
        self.max_group = max_group
        self.searched = 0
        self.rejected: dict[str, int] = {}
        self._cms: dict[int, CostModel] = {}  # one cost model per graph (its caches are per graph)
        self._prints: dict[int, str] = {}  # graph fingerprints
        self._layers: dict[int, bool] = {}  # graph -> has repeated layers (recompute groups)

    def _training(self, **kw: Any) -> Training:
        """How candidates are priced: the search's precision (fp8: bf16 with the graphs' float8
        linears, torchao's default choice, at the fp8 peak) and its compile setting."""
        if self.dtype != "fp8":
            return Training(dtype=self.dtype, compiled=self.compile is True, **kw)
        if self._fp8_ops is None:
            self._fp8_ops = frozenset(n for g in self.graphs.values() for n in float8_linears(g))
            # ZeRO-3 gathers their weights in float8 (fp8_all_gather's default; priced only at zero 3)
            self._fp8_gathered = frozenset(v for g in self.graphs.values() for v in float8_weights(g))
        return Training(dtype="bf16", fp8_ops=self._fp8_ops, fp8_gathered=self._fp8_gathered,
                        compiled=self.compile is True, **kw)

    # -- configurations ---------------------------------------------------------------------------------
    def group_sizes(self) -> list[int]:
        if self.unit_mode:
            return [self.world // pp for pp in divisors(self.world)]
        # stages of at most a node by default: tensor parallelism across nodes is slower on every
        # cluster the presets describe; max_group= widens it
        cap = self.max_group or self.cluster.devices_per_node
        return [g for g in divisors(self.world) if g <= cap]

    def meshes_for(self, g: int, graph: Optional[Graph] = None) -> list[tuple]:
        """The group as one axis, or (unit mode, or where context parallelism is searched: cp on the
        outer axis, tp on the inner) every 2-D view of it."""
        if self.unit_mode or (graph is not None and self._cp_for(graph)):
            return meshes(g)
        return [(g,)]

    def _allowed(self, cfg: Config) -> bool:
        ok = True
        for c in self.constraints:
            if not c.allows(cfg):
                self.rejected[c.describe()] = self.rejected.get(c.describe(), 0) + 1
                ok = False
        return ok

    # -- the run ------------------------------------------------------------------------------------------
    def run(self) -> ParetoSet:
        t0 = time.monotonic()
        training = self._training()
        candidates: list[Candidate] = []
        intra_jobs = [(b, g, mesh) for b in sorted(self.graphs) for g in self.group_sizes()
                      for mesh in self.meshes_for(g, self.graphs[b])]
        self.progress.set("intra-op choices", len(intra_jobs))
        solved: list[tuple[int, int, list[IntraResult], CostModel]] = []
        for b, g, mesh in intra_jobs:
            graph = self.graphs[b]
            cm = self._cost_model(graph)
            dp_hint = 1 if self.unit_mode else max(1, self.world // g)
            m_hint = self._m_hint(b, dp_hint)
            solver = IntraSolver(graph, cm, training, mesh, self.constraints, self.hf, m_hint, dp_hint,
                                 context_parallel=self._cp_for(graph))
            results = solver.solve()
            if self.sequence_parallel:
                seen = {r.key() for r in results}
                for r in [solver.with_sequence_parallel(r) for r in results if r.tp > 1]:
                    if r is not None and r.key() not in seen:
                        seen.add(r.key())
                        results.append(r)
            solved.append((b, g, results, cm))
            self.progress.step()
        self.progress.set("pipelines and knobs", len(solved))
        for b, g, results, cm in solved:
            for intra in results:
                candidates += self._inter(self.graphs[b], cm, b, g, intra)
            self.progress.step()
        self.searched = len(candidates)
        if not candidates:
            raise SearchError(self._no_plan_message())
        candidates, why_copies = self._parallel(candidates)
        fitting = [c for c in candidates if c.memory <= self.memory_limit * 1.1]
        if not fitting:
            raise SearchError(self._memory_message(candidates))
        chosen = self._shortlist(fitting)
        self.progress.set("simulating the shortlist", len(chosen))
        plans, estimates = [], []
        for cand in chosen:
            plan = self.materialize(cand)
            est = replay_plan(plan, self.cluster, cand.graph, self._cost_model(cand.graph))
            plan.estimate = est.to_json()
            plans.append(plan)
            estimates.append(est)
            self.progress.step()
        keep = [i for i in range(len(plans)) if estimates[i].max_memory_bytes <= self.memory_limit]
        if not keep:
            raise SearchError(self._memory_message(candidates, estimates))
        front = frontier([(estimates[i].step_time_s, estimates[i].max_memory_bytes) for i in keep])
        order = [keep[i] for i in front]
        # The plans are written from choices the rules allowed; the fastest is validated here (the
        # same checks as any plan, with its schedule's dry run), the others when they are used.
        from nnscaler_plugins.plan.validate import validate
        validate(plans[order[0]], chosen[order[0]].graph, world_size=self.world)
        seconds = time.monotonic() - t0
        self.progress.close(f"{len(order)} plan(s) on the frontier, {self.searched} candidates priced")
        result = ParetoSet([plans[i] for i in order], [estimates[i] for i in order], self.searched, len(plans), seconds)
        if why_copies is not None:
            for plan in result.plans:
                plan.options["why_copies"] = why_copies
            result.notes.append(why_copies)
        return result

    def _parallel(self, cands: list[Candidate]) -> tuple[list[Candidate], Optional[str]]:
        """The candidates whose devices divide the work (at most `replication.PARALLEL` of it done
        twice), when there are any: a plan that copies the model onto every device of its group is
        one device's plan on more devices, whatever the cost model says of its speed. Otherwise the
        ones that duplicate least, with the reason no plan divides the work (None when some do)."""
        keep = [c for c in cands if c.intra.duplicated <= PARALLEL]
        if keep:
            return keep, None
        least = min(c.intra.duplicated for c in cands)
        keep = [c for c in cands if c.intra.duplicated <= least + 1e-9]
        return keep, self._why_copies(keep[0])

    def _why_copies(self, cand: Candidate) -> str:
        g, graph = cand.cfg.group, cand.graph
        b = batch_size(graph)
        if b is None:
            batch = "the model's inputs have no batch dim to split"
        elif b % g:
            batch = f"the batch of {b} rows does not split {g} ways (data parallelism needs a multiple of {g})"
        else:
            batch = "the batch dim reaches no op that may split it"
        bound = [c.describe() for c in self.constraints if type(c).allows_op is not Constraint.allows_op]
        if bound:
            rest = f"; the constraints {', '.join(bound)} keep ops whole"
        elif cand.intra.tp > 1 or cand.intra.cp > 1:
            rest = ", and the ops whose other dims split (tensor or context parallelism) are not most of the work"
        else:
            rest = f", and no op's other dims split {g} ways"
        why = batch + rest
        return (f"every plan for groups of {g} devices computes {cand.intra.duplicated:.0%} of the work again on "
                f"several devices: {why}. Give the step a batch divisible by {g}, or run on fewer devices")

    def _cp_for(self, graph: Graph) -> bool:
        """Whether context parallelism is searched on this graph: as asked, else where some
        self-attention is long (`LONG_SEQUENCE` tokens or more), which is where activations dominate."""
        if self.context_parallel is not None:
            return bool(self.context_parallel)
        return any(kind_of(graph, op) == "attention" and graph.meta(op.inputs[0]).ndim >= 3
                   and graph.meta(op.inputs[0]).shape[-2] >= LONG_SEQUENCE for op in graph.ops)

    def _has_layers(self, graph: Graph) -> bool:
        hit = self._layers.get(id(graph))
        if hit is None:
            from nnscaler_plugins.plan.layers import layer_groups
            hit = self._layers[id(graph)] = bool(layer_groups(graph).layers)
        return hit

    def _cost_model(self, graph: Graph) -> CostModel:
        cm = self._cms.get(id(graph))
        if cm is None:
            cm = self._cms[id(graph)] = CostModel(graph, self.cluster)
        return cm

    def _m_hint(self, b: int, dp: int) -> int:
        if self.unit_mode or self.global_batch is None:
            return self.fixed_m or 1
        return max(1, self.global_batch // max(1, b * dp))

    def _micro_batches(self, b: int, dp: int) -> Optional[int]:
        if self.unit_mode:
            return self.fixed_m or 1
        G = self.global_batch if self.global_batch is not None else b * self.world
        if G % (b * dp):
            return None
        return G // (b * dp)

    def _inter(self, graph: Graph, cm: CostModel, b: int, g: int, intra: IntraResult) -> list[Candidate]:
        out = []
        layers = intra.layer_segments
        L = len(layers)
        weights = [s.fwd + s.bwd_input + s.bwd_weight + s.fwd_comm + s.bwd_comm for s in layers]
        pre, post = intra.pre or Segment(), intra.post or Segment()
        pre_w = pre.fwd + pre.bwd_input + pre.bwd_weight + pre.fwd_comm + pre.bwd_comm
        post_w = post.fwd + post.bwd_input + post.bwd_weight + post.fwd_comm + post.bwd_comm
        has_core = any(s.core_fwd for s in layers)
        for pp in divisors(self.world // g):
            if pp > max(1, L):
                continue
            dp = 1 if self.unit_mode else self.world // (g * pp)
            if self.unit_mode and g * pp != self.world:
                continue
            m = self._micro_batches(b, dp)
            if m is None:
                continue
            schedules = [("none", 1)] if pp == 1 else []
            if pp > 1:
                for s in self.schedules:
                    if s == "interleaved":
                        for v in (2, 3, 4):
                            if L >= pp * v and m % pp == 0:
                                schedules.append((s, v))
                    elif s == "zero-bubble" or s in ("1f1b", "gpipe"):
                        schedules.append((s, 1))
            # ZeRO shards across the plan's replicas (the runtime's FlatShard); with one it is a no-op
            zeros = [0, 1, 2, 3] if dp > 1 else [0]
            # recomputation runs the layers' recompute groups (materialize); a graph without layers
            # has none to run, so it is not priced there
            recomputes = [r for r in RECOMPUTE if r != "selective" or has_core] if self._has_layers(graph) \
                else ["none"]
            for schedule, v in schedules:
                stages = pp * v
                w = list(weights)
                if w:
                    w[0] += pre_w
                    w[-1] += post_w
                bounds = _stage_bounds(w, stages) if L else [0, 0]
                if bounds is None:
                    continue
                for zero in zeros:
                    if zero == 3 and schedule == "zero-bubble":  # the runtime refuses it (Plan.check_runnable)
                        continue
                    for rec in recomputes:
                        cfg = Config(group=g, mesh=intra.mesh, pp=pp, dp=dp, micro_batch_size=b, micro_batches=m,
                                     schedule=schedule, virtual=v, zero=zero, recompute=rec, tp=intra.tp,
                                     sequence_parallel=intra.sequence_parallel, cp=intra.cp,
                                     cp_comm=intra.cp_comm if intra.cp > 1 else "ring", ep=intra.ep, batch=intra.batch)
                        if not self._allowed(cfg):
                            continue
                        t, mem = self._price(cm, cfg, intra, bounds, pre, post, layers)
                        out.append(Candidate(cfg, intra, bounds, t, mem, graph))
        return out

    def _price(self, cm: CostModel, cfg: Config, intra: IntraResult, bounds: list[int], pre: Segment, post: Segment,
               layers: list[Segment]) -> tuple[float, float]:
        training = self._training(zero=cfg.zero, recompute=cfg.recompute)
        S = cfg.stages
        mode = MODE[cfg.recompute]
        parts_per_stage: list[list[Part]] = []
        for k in range(S):
            parts = []
            if k == 0:
                parts.append(Part(pre, 1, mode))
            parts += _runs(layers[bounds[k]:bounds[k + 1]], mode) if layers else []
            if k == S - 1:
                parts.append(Part(post, 1, mode))
            parts_per_stage.append(parts)
        devices = [list(range((k % cfg.pp) * cfg.group, (k % cfg.pp) * cfg.group + cfg.group)) for k in range(S)]
        stages = compose(cm, training, parts_per_stage, devices, cfg.dp, cfg.unit_size, cfg.micro_batches,
                         cfg.schedule == "zero-bubble")
        boundary = {}
        for k in range(1, S):
            first = layers[bounds[k]] if layers and bounds[k] < len(layers) else None
            if first is not None:
                boundary[(k - 1, k)] = sum(first.incoming.values())
        net = cm.net
        dpn = self.cluster.devices_per_node

        def transfer(src: int, dst: int, grad: bool) -> float:
            nbytes = boundary.get((min(src, dst), max(src, dst)), 0.0)
            if nbytes <= 0:
                return 0.0
            a, b = devices[src], devices[dst]
            cross = len({d // dpn for d in a + b}) > 1
            inner = net.all_gather(nbytes, cm._span(b)) if len(b) > 1 else 0.0
            return net.p2p(nbytes / max(1, len(a)), cross) + inner

        step = analytic_step(stages, cfg.schedule, cfg.pp, cfg.virtual, cfg.micro_batches, transfer,
                             overlap_factor(self.cluster))
        per_rank = [0.0] * cfg.pp  # a rank holds the states of all its chunks
        for k, st in enumerate(stages):
            per_rank[k % cfg.pp] += st.static
        memory = max(per_rank[k % cfg.pp] + step.act_peak[k] for k in range(len(stages)))
        return step.time, memory

    # -- choosing what to simulate --------------------------------------------------------------------------
    def _shortlist(self, cands: list[Candidate]) -> list[Candidate]:
        cands = sorted(cands, key=lambda c: (c.time, c.memory, c.describe()))
        pts = [(c.time, c.memory) for c in cands]
        front = frontier(pts)
        chosen: list[int] = []
        # the fastest few (the analytic times are close to, not equal to, the simulated ones) ...
        for i in range(min(len(cands), max(3, self.max_simulated // 2))):
            chosen.append(i)
        # ... and the frontier spread over memory
        step = max(1, len(front) // max(1, self.max_simulated - len(chosen)))
        for i in front[::step]:
            if i not in chosen and len(chosen) < self.max_simulated:
                chosen.append(i)
        return [cands[i] for i in chosen]

    # -- plans ---------------------------------------------------------------------------------------------
    def materialize(self, cand: Candidate) -> Plan:
        """The candidate as a Plan: each op's split and devices, the pipeline's op-order, recompute groups.

        Written out directly (what op_trans / op_assign / op_order record) rather than through a
        PlanBuilder, which would re-derive every op's signature for each of the shortlisted plans;
        the plans returned are validated like any other (`validate`, with the schedule's dry run)."""
        cfg, graph = cand.cfg, cand.graph
        from nnscaler_plugins.plan.layers import layer_groups
        from nnscaler_plugins.plan.plan import OpPlacement, PipelineSpec
        from nnscaler_plugins.plan.schedules import SPLITS_BACKWARD

        groups = layer_groups(graph)
        S = cfg.stages
        stage_devices = [list(range((k % cfg.pp) * cfg.group, (k % cfg.pp) * cfg.group + cfg.group)) for k in range(S)]
        stage_of: dict[str, int] = {}
        if cfg.pp > 1 and groups.layers:
            for k in range(S):
                for layer in groups.layers[cand.bounds[k]:cand.bounds[k + 1]]:
                    for op in layer:
                        stage_of[op.name] = k
            for op in groups.pre:
                stage_of[op.name] = 0
            for op in groups.post:
                stage_of[op.name] = S - 1
        recompute_of: dict[str, int] = {}
        if cfg.recompute != "none" and groups.layers:
            costs = self._cost_model(graph).costs
            gid = 0
            for layer in groups.layers:
                ops = [op.name for op in layer if cfg.recompute == "full" or costs.ops[op.name].core]
                if ops:
                    for name in ops:
                        recompute_of[name] = gid
                    gid += 1
        ops: dict[str, OpPlacement] = {}
        for op in graph.ops:
            k = stage_of.get(op.name, 0)
            p = cand.intra.choices[op.name].placement(stage_devices[k])
            ops[op.name] = OpPlacement([tuple(s) for s in p.splits], p.replicate, list(p.devices), dict(p.blocks),
                                       k if cfg.pp > 1 else None, recompute_of.get(op.name))
        pipeline = None
        if cfg.pp > 1:
            pipeline = PipelineSpec(stage_devices, cfg.micro_batches, cfg.schedule, [k % cfg.pp for k in range(S)],
                                    cfg.schedule in SPLITS_BACKWARD)
        # How the plan was priced, for people (`explain`) and the checkpoint's record: the runtime and
        # `simulate` read the plan's mesh, fields and knobs, never these.
        options = {"micro_batch_size": cfg.micro_batch_size,
                   "global_batch_size": cfg.micro_batch_size * cfg.micro_batches * cfg.dp, "summary": cand.describe()}
        knobs = Knobs(recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                      cp_comm=cfg.cp_comm if cfg.cp > 1 else "ring", cluster=self.cluster.name,
                      compile=self.compile is True,
                      experts_as_one_op=any(kind_of(graph, op) == "experts" for op in graph.ops))
        if id(graph) not in self._prints:
            self._prints[id(graph)] = graph.fingerprint()
        plan = Plan(graph_fingerprint=self._prints[id(graph)], model_class=graph.model_class, unit_size=cfg.unit_size,
                    dp=cfg.dp, ops=ops, strategy="search", options=options, pipeline=pipeline,
                    micro_batches=cfg.micro_batches, zero=cfg.zero, precision=self.dtype, mesh=mesh_of_config(cfg),
                    knobs=knobs)
        plan.input_shapes = {i.path[1] if len(i.path) == 2 else ".".join(map(str, i.path[1:])):
                             list(graph.meta(i.name).shape) for i in graph.inputs if graph.values[i.name].meta is not None}
        plan.structure_fingerprint = graph.structure_fingerprint()
        plan.graph = graph
        return plan

    # -- messages ------------------------------------------------------------------------------------------
    def _no_plan_message(self) -> str:
        if self.rejected:
            worst = sorted(self.rejected.items(), key=lambda kv: -kv[1])
            names = "; ".join(f"'{k}' (rejected {n} configurations)" for k, n in worst)
            return (f"no plan for {self.world} devices satisfies the constraints; binding: {names}. "
                    "Relax the first of these.")
        return (f"no plan found for {self.world} devices: no pipeline, data-parallel and micro-batch split divides "
                f"the global batch {self.global_batch} with micro-batches of {sorted(self.graphs)}; choose a global "
                "batch divisible by the micro-batch size times the data-parallel degree")

    def _memory_message(self, cands: list[Candidate], estimates: Optional[list[Estimate]] = None) -> str:
        smallest = min(cands, key=lambda c: c.memory)
        lowest = smallest.memory
        if estimates:
            lowest = min(lowest, min(e.max_memory_bytes for e in estimates))
        source = "the memory limit" if self.memory_from_user else f"the device memory of {self.cluster.name}"
        dp = [c for c in cands if c.intra.duplicated <= PARALLEL and c.cfg.tp == 1 and c.cfg.cp == 1 and c.cfg.pp == 1
              and c.cfg.dp * c.intra.batch == self.world]
        needs = (f"data parallelism over {self.world} devices needs {min(c.memory for c in dp) / GiB:.2f} GiB per "
                 "device, and no other plan fits either. ") if dp else ""
        return (f"binding constraint: peak memory per device <= {self.memory_limit / GiB:.2f} GiB ({source}); "
                f"{needs}the smallest peak any plan reaches is {lowest / GiB:.2f} GiB ({smallest.describe()}). Use more "
                "devices, a smaller micro-batch, or allow ZeRO-3 / full recomputation if a constraint excludes them.")


def search(model_or_graph: Any, *, world_size: int, cluster: Union[ClusterSpec, str, None] = None,
           constraints: Iterable[Constraint] = (), example_inputs: Any = None,
           global_batch_size: Optional[int] = None, memory_limit: Union[None, float, str] = None,
           progress: bool = True, data_parallel: str = "replicas", micro_batches: Optional[int] = None,
           max_simulated: int = 8, max_group: Optional[int] = None, sequence_parallel: bool = False,
           precision: Optional[str] = None, lengths: Any = None, context_parallel: Optional[bool] = None,
           expert_parallel: bool = True, compile: Optional[bool] = False, fp8: bool = False) -> ParetoSet:
    """Search plans for `world_size` devices of `cluster`; returns a ParetoSet, fastest plan first.

    `model_or_graph`: a captured Graph of one micro-batch, or a model with `example_inputs` (one
    micro-batch; with a `MicroBatchSize` constraint the model is captured at each allowed size, taken
    from the first rows of the example inputs). Each plan's `micro_batches` says how many such
    micro-batches one replica takes per step: `nns.parallelize(model, batch, plan=p)` is given
    micro-batch x micro-batches rows per replica. `global_batch_size`: samples per training step over
    all replicas (default: the micro-batch times the world size). `memory_limit`: bytes or "40GiB"
    (default: the cluster's device memory). `data_parallel="unit"` puts data parallelism inside the
    unit (the graph is then one micro-batch of the whole step, every replica's rows together; used by
    strategy="auto"). `precision`: "fp32", "bf16" or "fp16", the precision plans are priced in and
    run in (each plan's `precision`); default: the cluster's training dtype (bf16 on the A100 and
    H100 presets, fp16 on V100, fp32 on `local-cpu`). `sequence_parallel=True` also considers
    Megatron's sequence parallelism: the norms, dropouts and residual adds of the layers split along
    the sequence (the plans carry those splits, as the `megatron` strategy's option of that name does).
    `lengths`: the sequence lengths to price for, when they differ from the example's: one length,
    a list of lengths seen in the data, or a `{length: weight}` histogram (see search/lengths.py:
    searched at the weighted mean, each frontier plan then priced at every length: mean step time,
    largest peak memory). The plans run at any length; this only says which ones to optimize for.
    `context_parallel`: also search attention split along its sequence (cp, each `cp_comm`: ring,
    allgather, ulysses; priced by `group_kernels`); default: where some self-attention has
    `LONG_SEQUENCE` tokens or more. `expert_parallel` (default True): a model's mixture-of-experts
    layers (stacked-experts modules, `capture/experts.py`) are captured as one op each, so that
    splitting their experts with their tokens (ep, all-to-all) is in the space beside keeping them
    whole; False captures them as written (a graph passed in is searched as it was captured).
    `compile`: False (default) plans run eagerly; True every plan runs under torch.compile (the
    compile knob) and is priced so (element-wise chains fused); None puts it in the space: each plan
    compiled where that is priced faster (the GPU presets, see costmodel.compiles_faster). `fp8=True` puts precision fp8
    in the space beside bf16 where the cluster's devices multiply in float8 (an fp8 peak: H100,
    H200): each plan then trains in fp8 where that is priced faster (float8 numerics: opt in).
    """
    from nnscaler_plugins.plugins import get_plugin_manager

    if world_size < 1:
        raise SearchError(f"world_size must be >= 1 (got {world_size})")
    options = {"constraints": list(constraints), "world_size": world_size, "cluster": cluster,
               "global_batch_size": global_batch_size, "memory_limit": memory_limit, "precision": precision}
    hooks = get_plugin_manager().hook
    hooks.nnscaler_search_options(options=options)
    constraints, world_size = options["constraints"], int(options["world_size"])
    spec = _resolve_cluster(options["cluster"], world_size)
    pairs = None
    if lengths is not None:
        from nnscaler_plugins.search.lengths import at_length, histogram, representative

        if isinstance(model_or_graph, Graph) or example_inputs is None:
            raise SearchError("lengths= needs the model and example_inputs= (a graph is captured at one length)")
        pairs = histogram(lengths)
        example_inputs = at_length(example_inputs, representative(pairs))
    graphs = _graphs(model_or_graph, example_inputs, constraints, expert_parallel)
    limit = parse_bytes(options["memory_limit"]) if options["memory_limit"] is not None else None
    s = Search(graphs, world_size, spec, constraints, options["global_batch_size"], limit, progress,
               unit_mode=(data_parallel == "unit"), micro_batches=micro_batches, max_simulated=max_simulated,
               max_group=max_group, sequence_parallel=sequence_parallel, precision=options["precision"],
               context_parallel=context_parallel, compile=compile)
    result = s.run()
    if compile is None or fp8:
        result = _choose_speed_knobs(result, spec, compile, fp8, s)
    if pairs is not None and len(pairs) > 1:
        result = _over_lengths(result, pairs, model_or_graph, example_inputs, spec, s)
    hooks.nnscaler_search_result(result=result, options=options)
    if not result.plans:
        raise SearchError("a search plugin removed every plan from the result (nnscaler_search_result hook)")
    return result


def _choose_speed_knobs(result: ParetoSet, spec: ClusterSpec, compile: Optional[bool], fp8: bool,
                        search: "Search") -> ParetoSet:
    """Each frontier plan with the fastest of its compile / fp8 variants the cluster supports
    (compile: results unchanged, kernels faster; fp8: bf16 plans' linears in float8), repriced;
    then the frontier again."""
    plans, estimates = [], []
    for plan in result.plans:
        compiles = [False, True] if compile is None and compiles_faster(spec) else [compile is True]
        precisions = [plan.precision] + (["fp8"] if fp8 and supports_fp8(spec) and plan.precision == "bf16" else [])
        best = None
        for c in compiles:
            for prec in precisions:
                variant = dataclasses.replace(plan, precision=prec, knobs=plan.knobs.replace(compile=c))
                est = replay_plan(variant, spec, plan.graph, search._cost_model(plan.graph))
                if best is None or est.step_time_s < best[1].step_time_s:
                    best = (variant, est)
        best[0].estimate = best[1].to_json()
        plans.append(best[0])
        estimates.append(best[1])
    order = frontier([(e.step_time_s, e.max_memory_bytes) for e in estimates])
    out = ParetoSet([plans[i] for i in order], [estimates[i] for i in order], result.searched, result.simulated,
                    result.seconds)
    out.notes = list(result.notes) + [f"compile and fp8 chosen per plan where {spec.name} prices them faster"]
    return out


def _over_lengths(result: ParetoSet, pairs: list, model: Any, example_inputs: Any, spec: ClusterSpec,
                  search: "Search") -> ParetoSet:
    """The frontier again, each plan priced over the length histogram."""
    from nnscaler_plugins.capture.experts import experts_as_one_op
    from nnscaler_plugins.batches import batch_size as inputs_batch
    from nnscaler_plugins.batches import normalize_inputs
    from nnscaler_plugins.capture.tracing import capture
    from nnscaler_plugins.search.lengths import at_length, price_over_lengths

    full = inputs_batch(example_inputs) or 1
    graphs: dict[tuple[int, int], Graph] = {}

    def graph_at(plan: Plan, n: int) -> Graph:
        b = batch_size(plan.graph) or full
        if (b, n) not in graphs:
            args, kwargs = normalize_inputs(at_length(_first_rows(example_inputs, b, full), n), None)
            with experts_as_one_op(model) if plan.knobs.experts_as_one_op else contextlib.nullcontext():
                graphs[(b, n)] = capture(model, args, kwargs)
        return graphs[(b, n)]

    estimates = price_over_lengths(result.plans, pairs, graph_at,
                                   lambda p, g: replay_plan(p, spec, g, CostModel(g, spec)))
    for plan, est in zip(result.plans, estimates):
        plan.estimate = est.to_json()
    keep = [i for i, e in enumerate(estimates) if e.max_memory_bytes <= search.memory_limit]
    if not keep:
        raise SearchError(f"no plan of the frontier fits {search.memory_limit / 2**30:.1f} GiB at the longest length "
                          f"({max(n for n, _ in pairs)}); lower the batch or allow more memory")
    order = [keep[i] for i in frontier([(estimates[i].step_time_s, estimates[i].max_memory_bytes) for i in keep])]
    out = ParetoSet([result.plans[i] for i in order], [estimates[i] for i in order], result.searched,
                    result.simulated, result.seconds)
    out.notes = list(result.notes) + [f"priced over lengths {[n for n, _ in pairs]} (weights "
                                      f"{[round(w, 3) for _, w in pairs]}): mean step time, largest peak memory"]
    return out


def _precision(precision: Optional[str], cluster: ClusterSpec) -> str:
    """The precision plans are priced and run in: the one asked for, else the cluster's training dtype."""
    dtype = str(precision) if precision is not None else cluster.dtype
    if dtype not in PRECISIONS:
        source = f"precision={precision!r}" if precision is not None else \
            f"cluster {cluster.name!r} prices training in {dtype!r}"
        raise SearchError(f"{source}, which the runtime does not run; pass precision= one of {', '.join(PRECISIONS)}")
    if dtype not in cluster.peak_flops:
        raise SearchError(f"cluster {cluster.name!r} has no peak FLOP/s for {dtype!r} (it knows "
                          f"{sorted(cluster.peak_flops)}); pass precision= one of those or add it to the cluster")
    return dtype


def _resolve_cluster(cluster: Union[ClusterSpec, str, None], world_size: int) -> ClusterSpec:
    if cluster is None:
        cluster = "local-cpu"
    if isinstance(cluster, ClusterSpec):
        spec = cluster
    else:
        spec = make_cluster(cluster) if str(cluster) != "local-cpu" else make_cluster(cluster, devices=world_size)
        if spec.num_devices < world_size and str(cluster) in PRESETS:
            spec = spec.with_nodes(-(-world_size // spec.devices_per_node))
    if spec.num_devices < world_size:
        raise SearchError(f"cluster {spec.name!r} has {spec.num_devices} devices ({spec.nodes} node(s) x "
                          f"{spec.devices_per_node}) but world_size is {world_size}; describe a larger cluster "
                          f"(nodes={-(-world_size // spec.devices_per_node)})")
    return spec


def _graphs(model_or_graph: Any, example_inputs: Any, constraints: Sequence,
            whole_experts: bool = True) -> dict[int, Graph]:
    if isinstance(model_or_graph, Graph):
        b = batch_size(model_or_graph) or 1
        return {b: model_or_graph}
    if example_inputs is None:
        raise TypeError("searching a model needs example_inputs= (one micro-batch of what its forward takes)")
    from nnscaler_plugins.capture.experts import experts_as_one_op
    from nnscaler_plugins.batches import batch_size as inputs_batch
    from nnscaler_plugins.batches import normalize_inputs
    from nnscaler_plugins.capture.tracing import capture

    sizes = None
    for c in constraints:
        if isinstance(c, MicroBatchSize):
            sizes = sorted(c.sizes)
    full = inputs_batch(example_inputs) or 1
    if sizes is None:
        sizes = [full]
    out = {}
    for b in sizes:
        if b > full or b < 1:
            continue
        inputs = _first_rows(example_inputs, b, full)
        args, kwargs = normalize_inputs(inputs, None)
        with experts_as_one_op(model_or_graph) if whole_experts else contextlib.nullcontext():
            out[b] = capture(model_or_graph, args, kwargs)
    if not out:
        raise SearchError(f"binding constraint: micro-batch size in {sizes}, but the example inputs have a batch of "
                          f"{full}; pass example inputs with at least {min(sizes)} rows")
    return out


def _first_rows(batch: Any, b: int, full: int) -> Any:
    import torch
    import torch.utils._pytree as pytree

    if b == full:
        return batch
    return pytree.tree_map(lambda x: x[:b] if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == full
                           else x, batch)
