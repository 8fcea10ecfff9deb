"""nnscaler-plugins: parallelization plans for PyTorch models, searched or written with op-trans,
op-assign and op-order, turned into per-rank code over torch.distributed.

    import nnscaler_plugins as nns
    graph = nns.capture(model, kwargs=batch)
    plan = nns.plan(graph, strategy="tp", world_size=4)
    module = nns.parallelize(model, batch, plan=plan)   # on every rank: an nns.ParallelModule

The public names are listed in `__all__`; docs/design.md says what each stage does.
"""
from nnscaler_plugins import (
    checkpoint,  # nns.checkpoint.save / load / export / merge
    search,  # a callable module: nns.search(...) runs the search, nns.search.constraints etc.
)
from nnscaler_plugins.api import capture, compile, parallelize, plan, strategies
from nnscaler_plugins.compiler import Artifact, Compiled
from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.capture.tracing import CaptureError
from nnscaler_plugins.errors import NonFiniteError, PlanError
from nnscaler_plugins.framework_imports import watch as _watch_frameworks
from nnscaler_plugins.plan.plan import OpPlacement, Plan
from nnscaler_plugins.plan.primitives import (
    PlanBuilder,
    SubOp,
    op_assign,
    op_order,
    op_trans,
)
from nnscaler_plugins.runtime.optimizer import build_optimizer
from nnscaler_plugins.search import (
    ClusterSpec,
    Estimate,
    ParetoSet,
    SearchError,
    cluster,
    constraints,
    simulate,
)

import sys as _sys

from nnscaler_plugins import api as _api
from nnscaler_plugins.plan import schedules as _schedules
from nnscaler_plugins.plan import timeline as _timeline

# `nns.plan` and `nns.capture` are the functions; the subpackages of the same names (plan/, capture/)
# are reached by import (`from nnscaler_plugins.plan import Plan`), never as these attributes.
plan = _api.plan
capture = _api.capture
# Module paths earlier releases documented, kept importable: nnscaler_plugins.schedules.Task,
# nnscaler_plugins.timeline.check (now under plan/).
_sys.modules.setdefault(__name__ + ".schedules", _schedules)
_sys.modules.setdefault(__name__ + ".timeline", _timeline)

_watch_frameworks()  # Trainer(strategy="nnscaler") once Lightning is imported, without importing it now

__version__ = "0.1.0"

__all__ = ["capture", "CaptureError", "plan", "compile", "Compiled", "Artifact", "parallelize", "strategies", "Plan", "OpPlacement", "PlanError",
           "PlanBuilder", "SubOp", "op_trans", "op_assign", "op_order", "Graph", "__version__"]
__all__ += ["search", "cluster", "simulate", "ClusterSpec", "Estimate", "ParetoSet", "SearchError", "constraints"]
__all__ += ["checkpoint"]
__all__ += ["build_optimizer"]
__all__ += ["ParallelModule", "init_weights"]
__all__ += ["NonFiniteError"]


def __getattr__(name: str):
    # nns.ParallelModule is imported on first use: the runtime is only needed by processes that
    # run a plan, and `import nnscaler_plugins` stays light (no process group is needed either way).
    if name == "ParallelModule":
        from nnscaler_plugins.runtime.parallel_module import ParallelModule
        return ParallelModule
    if name == "init_weights":  # the one-process reference of a meta-device model's initialization
        from nnscaler_plugins.runtime.materialize import init_weights
        return init_weights
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
