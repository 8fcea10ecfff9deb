"""The Program of a plan whose forward runs eagerly: where each parameter and buffer is stored, no ops.

A plan that keeps whole layers on each device (one device per replica, no pipeline) needs no per-op
lowering: every parameter and buffer is whole on the replica's one device, its gradient averaged over
the replicas, its training state cut per the ZeRO stage. Writing that as an ordinary `Program` (shard
specs, no statements) lets every part of the runtime that reads shard specs -- the gradient reducer,
ZeRO's chunks, the sharded optimizer, checkpoints, whole state dicts, the flight recorder -- serve the
eager executor unchanged, and makes a checkpoint of either executor load into the other: both store
the same tensors under the same names in the same layouts.
"""
from __future__ import annotations

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.lower.lowering import ParamShard, Program, RankProgram, StageProgram
from nnscaler_plugins.plan.plan import Plan


def runs_eagerly(plan: Plan) -> bool:
    """Whether `plan` can run the model's own forward: one device per replica and no pipeline, so that
    every device computes the whole model on its rows (data parallelism, ZeRO 1-3, offload)."""
    return plan.unit_size == 1 and plan.pipeline is None


def whole_program(graph: Graph, plan: Plan) -> Program:
    """The Program of `plan` over `graph`'s parameters and buffers, each whole on device 0 of the unit."""
    if not runs_eagerly(plan):
        raise PlanError(f"the plan ({plan.mesh.describe()}{', a pipeline' if plan.pipeline is not None else ''}) "
                        "splits the model across devices, so its forward cannot run as the model's own code; only "
                        "plans with one device per replica and no pipeline (dp, zero1, zero2, zero3, offload) can")
    shards: dict[str, ParamShard] = {}
    for name, v in graph.values.items():
        if v.kind not in ("param", "buffer") or v.meta is None:
            continue
        shards[name] = ParamShard(name, v.fqn or name, v.aliases, v.kind, Layout.replicated(v.meta.shape, (0,)),
                                  persistent=v.persistent)
    keys = list(shards)
    stage = StageProgram(stage=0, device=0, stmts=[], inputs=[], sent=[], outputs=[], params=keys)
    return Program(graph=graph, plan=plan, unit_size=1, ranks=[RankProgram(0, {0: stage}, keys)], shards=shards,
                   reshards=[], grad_groups=[], kernel_groups=[], loss_index=None, stage_groups=[(0,)],
                   stage_inputs=[[]], stage_sends=[[]], output_stage=[])
