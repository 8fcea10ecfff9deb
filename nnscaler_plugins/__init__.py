"""nnscaler-plugins: parallelization plans for PyTorch models, searched or written with op-trans,
op-assign and op-order, turned into per-rank code over torch.distributed.

    import nnscaler_plugins as nns
    graph = nns.capture(model, kwargs=batch)
    plan = nns.plan(graph, strategy="tp", world_size=4)
    module = nns.parallelize(model, batch, plan=plan)   # on every rank: an nns.ParallelModule

The public names are listed in `__all__`; docs/design.md says what each stage does.
"""
from .api import parallelize, plan, strategies
from .optimizer import build_optimizer
from .capture import CaptureError, capture
from .errors import PlanError
from .graph import Graph
from .plan import OpPlacement, Plan
from .primitives import PlanBuilder, SubOp, op_assign, op_order, op_trans
from .search import constraints
from .search import ClusterSpec, Estimate, ParetoSet, SearchError, cluster, simulate
from . import search  # a callable module: nns.search(...) runs the search, nns.search.constraints etc.
from . import checkpoint  # nns.checkpoint.save / load / export / merge
from .framework_imports import watch as _watch_frameworks

_watch_frameworks()  # Trainer(strategy="nnscaler") once Lightning is imported, without importing it now

__version__ = "0.1.0"

__all__ = ["capture", "CaptureError", "plan", "parallelize", "strategies", "Plan", "OpPlacement", "PlanError",
           "PlanBuilder", "SubOp", "op_trans", "op_assign", "op_order", "Graph", "__version__"]
__all__ += ["search", "cluster", "simulate", "ClusterSpec", "Estimate", "ParetoSet", "SearchError", "constraints"]
__all__ += ["checkpoint"]
__all__ += ["build_optimizer"]
__all__ += ["ParallelModule"]


def __getattr__(name: str):
    # nns.ParallelModule is imported on first use: the runtime is only needed by processes that
    # run a plan, and `import nnscaler_plugins` stays light (no process group is needed either way).
    if name == "ParallelModule":
        from .runtime.parallel_module import ParallelModule
        return ParallelModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
