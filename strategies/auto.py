"""`auto`: the plan the search finds fastest on the cluster at hand, within its memory.

    plan = nns.plan(model, strategy="auto", world_size=4, example_inputs=batch)
    plan = nns.plan(model, strategy="auto", world_size=4, example_inputs=batch,
                    cluster=nns.cluster("local-cpu"), constraints=[MaxTensorParallel(2)])

`nns.plan` gives a strategy a unit of the whole world (the example inputs are the step's batch), so
the search runs with data parallelism inside the unit: every op may be split along its batch dim,
along a model dim, or both (a 2-D mesh), and the micro-batches are those `nns.plan` was given. The
cluster defaults to `local-cpu` with one device per rank, measured once and cached (every rank reads
the same numbers, so every rank finds the same plan), as many nodes as the launcher started (its
processes per node, LOCAL_WORLD_SIZE, in the plan's mesh), so tensor parallelism stays inside a
node unless the caller's constraints allow more. The plan's estimate is kept in its options.

The search prices the plan in the precision it will run in: `nns.plan(..., precision=)` (fp32
unless given), not the cluster's own training dtype, so the estimate is that of the plan that runs.

Unless the caller's constraints say otherwise the search is held to ZeRO stage 0 and no
recomputation. ZeRO shards states across data-parallel replicas, and a plan made here is one unit
(its data parallelism is a split of the batch dim inside the unit), so there is nothing to shard
across; recomputation only pays where memory binds, and passing `RecomputeModes([...])` lets the
search use it (the runtime runs the plan's recompute groups under checkpoint). With a single micro-batch a pipeline's stages run one after
another (and its plan cannot run DDP-style `forward`), so pipelines are only considered then when no
plan without one fits in memory.

The plan parallelizes: where the cost model prices "every device runs every op" fastest (slow
collectives next to small ops, as on a CPU), that plan would use the world like one device, so the
search keeps only plans whose devices divide the work (`search/replication.py`); data parallelism
is always among them when the batch divides over the devices. Only when no plan divides the work
(a batch that does not split, constraints that keep ops whole) is a copying plan returned, with a
warning and `options["why_copies"]` saying why, and a label that says every op is copied. When
nothing fits in memory the search's error names the memory limit and what data parallelism needs.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import apply_batch_statistics
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder
from nnscaler_plugins.search import cluster as make_cluster
from nnscaler_plugins.search.adopt import adopt
from nnscaler_plugins.search.constraints import PipelineStages, RecomputeModes, ZeroStages
from nnscaler_plugins.search.solver import SearchError, search


def _check(world_size: int, dp: Optional[int] = None, **_: Any) -> None:
    if dp not in (None, 1):
        raise PlanError("strategy 'auto' chooses data parallelism itself; leave dp= out (or use strategy='hybrid')")


#: The whole world is the unit until the search names its axes (`adopt` sets the searched plan's mesh).
MESH = MeshLayout(("dp", "unit"), fill=("unit",), check=_check)


def auto(builder: PlanBuilder, *, cluster: Any = None, constraints: Sequence = (), memory_limit: Optional[Any] = None,
         batch_statistics: Optional[str] = None, choose_compile: bool = False, choose_fp8: bool = False,
         **_: Any) -> None:
    """The searched plan is one unit (dp = 1): its batch splits leave partial sums the lowering adds
    up exactly, so the loss's nonlinear batch statistics (a router loss) are whole without
    combining; only micro-batches would compute them per micro-batch, which is refused before the
    search unless `batch_statistics="local"`.

    `compile=True` (the knob every strategy takes) prices the plans compiled; `choose_compile=True`
    lets the search compile the plan where the cluster prices that faster (the GPU presets), and
    `choose_fp8=True` makes the plan train in bf16 or in fp8, whichever the cluster prices faster
    (fp8 only where its devices multiply in float8: H100, H200); give it without precision=."""
    apply_batch_statistics(builder, batch_statistics)  # the search keeps the micro-batches
    constraints = list(constraints)
    if not any(isinstance(c, ZeroStages) for c in constraints):
        constraints.append(ZeroStages([0]))
    if not any(isinstance(c, RecomputeModes) for c in constraints):
        constraints.append(RecomputeModes(["none"]))

    if cluster is None or isinstance(cluster, str):
        name = cluster or "local-cpu"
        per_node = builder.mesh.devices_per_node if builder.mesh is not None else None
        if name == "local-cpu" and per_node and builder.unit_size % per_node == 0:  # the launcher's nodes
            cluster = make_cluster(name, nodes=builder.unit_size // per_node, devices=per_node)
        else:
            cluster = make_cluster(name, devices=builder.unit_size) if name == "local-cpu" else make_cluster(name)
    def run(extra: list):
        return search(builder.graph, world_size=builder.unit_size, cluster=cluster, constraints=constraints + extra,
                      memory_limit=memory_limit, progress=False, data_parallel="unit",
                      micro_batches=builder.micro_batches,
                      precision="bf16" if choose_fp8 and builder.precision_name == "fp32" else builder.precision_name,
                      compile=True if builder.knobs.compile else (None if choose_compile else False), fp8=choose_fp8)

    if builder.micro_batches == 1 and not any(isinstance(c, PipelineStages) for c in constraints):
        try:
            plans = run([PipelineStages([1])])
        except SearchError:
            plans = run([])
    else:
        plans = run([])
    adopt(builder, plans.best)  # its splits, pipeline, mesh and knobs (the cluster it was found for among them)
    builder.set_knobs(compile=plans.best.knobs.compile)  # as chosen (or asked for)
    why = plans.best.options.get("why_copies")
    if why:  # the search found nothing that divides the work: said where the plan is made, and in its options
        warnings.warn(f"strategy 'auto': {why}", stacklevel=2)


# Read by the entry points before capture (capture/experts.py: wants_experts_as_one_op): a
# mixture-of-experts layer captured as one op may be split along its experts (ep) and widths
# (etp) by the search, or run whole; captured as transformers writes it, only the whole is open.
auto.experts_as_one_op = True  # type: ignore[attr-defined]
