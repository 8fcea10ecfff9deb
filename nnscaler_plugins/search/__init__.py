"""Constraint-guided plan search: cluster specs, the cost model and simulator, the Pareto search.

    import nnscaler_plugins as nns
    spec = nns.cluster("a100-dgx", nodes=8)
    plans = nns.search(graph, world_size=64, cluster=spec, global_batch_size=512)   # ParetoSet
    est = nns.simulate(plans.best, spec)                                         # Estimate

Layers, each usable alone: `cluster` (ClusterSpec, presets, files, the measured local CPU),
`costmodel` and `simulator` (what a plan costs), `constraints` (what plans may be), `intraop` and
`solver` (the search), `pareto` (its answer). The search never touches torch.distributed.
"""
import inspect
import sys
import types

from nnscaler_plugins.search.cluster import (
    ClusterError,
    ClusterSpec,
    Link,
    cluster,
    presets,
)
from nnscaler_plugins.search.constraints import (
    Constraint,
    HFTensorParallelPlan,
    MaxTensorParallel,
    MemoryLimit,
    MicroBatchSize,
    NotSplit,
    PipelineStages,
    RecomputeModes,
    Replicated,
    SameLayerConfig,
    Schedules,
    ZeroStages,
    check,
)
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.efficiency import Efficiency
from nnscaler_plugins.search.pareto import ParetoSet
from nnscaler_plugins.search.simulator import Estimate, simulate
from nnscaler_plugins.search.solver import SearchError, search

__all__ = ["ClusterSpec", "ClusterError", "Link", "cluster", "presets", "CostModel", "Training", "Efficiency",
           "Estimate", "simulate", "ParetoSet", "SearchError", "search", "Constraint", "SameLayerConfig",
           "MaxTensorParallel", "Replicated", "NotSplit", "PipelineStages", "Schedules", "MicroBatchSize",
           "MemoryLimit", "ZeroStages", "RecomputeModes", "HFTensorParallelPlan", "check"]


class _CallableModule(types.ModuleType):
    """`nns.search(...)` is the search; `nns.search.constraints`, `import nnscaler_plugins.search.solver`
    and the other layers stay reachable as attributes of the same name (a plain function named like
    its package would hide them)."""

    def __call__(self, *args, **kwargs):
        return search(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(search)
