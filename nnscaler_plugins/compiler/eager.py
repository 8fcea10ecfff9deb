"""The compile stage of a plan that runs eagerly: its Program of shard specs, no generated module.

A plan whose forward is the model's own (`knobs.executor == "eager"`, see `runtime/eager_executor.py`)
compiles to an `Artifact` like any other, so the runtime takes both from the same place: the Program
says where every parameter and buffer is stored (`lower/eager.py`); there is no source file, no shape
template (the model's own code serves every batch size) and no loss-item counter (the eager executor
weighs replicas by their samples).
"""
from __future__ import annotations

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.compiler.artifact import Artifact
from nnscaler_plugins.lower.eager import whole_program
from nnscaler_plugins.plan.plan import Plan


def eager_artifact(graph: Graph, plan: Plan) -> Artifact:
    """The artifact of device 0 of `plan`'s one-device unit, over `graph`'s parameters and buffers."""
    return Artifact(whole_program(graph, plan), 0, module=None, source_path="", shapes=None, loss_items=None)
