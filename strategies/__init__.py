"""The built-in strategies, shipped as a plugin exactly like a third-party package would ship one.

The core finds this module through the `nnscaler_plugins` entry point and never imports it, so a
strategy written outside this repository has the same standing as these.

Registration: each strategy is registered as a `Strategy` object. It is callable like any
strategy (`strategy(builder, **options)`), and it also carries `mesh`, a `MeshLayout` that says how
its degree options (dp=, tp=, pp=, cp=, ep=, etp=) become the plan's typed mesh (`nns.plan` resolves
it in one place, `plan.mesh.resolve_mesh`, before it makes the builder), and `options`, the names of
the other options it takes; every entry point checks both before anything starts (a misspelt
`tpp=2` is refused naming `tp`; the options in `nnscaler_plugins.plan.source.COMMON_OPTIONS` --
zero, precision, micro_batches, micro_batch_size, cluster, constraints, the overlap, compile and
fault knobs -- are valid for every strategy and not listed). Each strategy is a short composition
of the public passes (`nnscaler_plugins.passes`); a third-party plugin uses the same names (a plain
function with `.mesh` or `.degrees` and `.options` attributes works too; see
`nnscaler_plugins.plan.source.strategy_options`).

    dp           every rank runs the whole model on its own batch (unit of 1 device, dp = world)
    tp           Megatron-style tensor parallelism over the whole world (or tp= devices, dp = world / tp)
    hybrid       tp= devices per unit, dp= units
    coshard      tp whose split ops run chunks= pieces per device in turn, recomputed in backward
    gpipe, 1f1b, interleaved, zero-bubble
                 pipelines of pp stages (x tp, x dp) with that schedule
    pipeline     the same with schedule= any built-in name or a function of your own
    interlaced   layers pipelined, embedding and LM head tensor-parallel over all devices
    megatron     tp x cp x pp x dp with Megatron's options
    zero1, zero2, zero3
                 dp with that ZeRO stage (every strategy also takes zero= and precision=)
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from nnscaler_plugins.hookspecs import hookimpl
from nnscaler_plugins.plan.mesh import Mesh, MeshLayout, resolve_mesh, unit_mesh
from nnscaler_plugins.plan.primitives import PlanBuilder

from . import auto as auto_search
from . import context_parallel, data_parallel, expert_parallel, pipeline, tensor_parallel


@dataclass(frozen=True)
class Strategy:
    """A named strategy: `apply(builder, **options)` plus how it lays out the mesh's degrees."""

    name: str
    apply: Callable[..., None]
    # How its degree options become the mesh; a plugin written before meshes may give its
    # `degrees(world_size, **options) -> (unit_size, dp)` function here instead.
    mesh: Union[MeshLayout, Callable[..., tuple[int, int]]]
    doc: str = ""
    # The options it takes besides those every strategy takes and its degrees; None: those of
    # `apply` (its keyword parameters, unchecked if it takes **options), see plan.source.strategy_options.
    options: Optional[tuple[str, ...]] = None
    # Whether its degrees are chosen from the captured graph (a search): its `mesh` is then only where the
    # search starts, and nothing before capture may split data by it (PlanSource.mesh_before_capture).
    mesh_after_capture: bool = False

    def __call__(self, builder: PlanBuilder, **options: Any) -> None:
        self.apply(builder, **options)

    def resolve_mesh(self, world_size: int, **options: Any) -> Mesh:
        """The mesh these options give on `world_size` devices (`plan.mesh.resolve_mesh`)."""
        if isinstance(self.mesh, MeshLayout):
            return resolve_mesh(self.mesh, world_size, options, self.name)
        unit, dp = self.mesh(world_size, **options)
        return unit_mesh(unit, dp)

    def degrees(self, world_size: int, **options: Any) -> tuple[int, int]:
        """(devices per model replica, data-parallel replicas) of `resolve_mesh`."""
        mesh = self.resolve_mesh(world_size, **options)
        return mesh.unit_size, mesh.replicas

    def __repr__(self) -> str:
        return f"<strategy {self.name}: {self.doc}>"


def _declared(*own: str) -> tuple[str, ...]:
    return tuple(own)


# Options each strategy reads besides its degrees (which its mesh layout names) and the options
# every strategy takes (zero, precision, micro_batches, ..., `plan.source.COMMON_OPTIONS`).
_UNIT = _declared("recompute", "batch_statistics")
_PIPELINE = _declared("virtual_stages", "recompute", "sequence_parallel", "batch_statistics")

DP = Strategy("dp", data_parallel.data_parallel, data_parallel.MESH,
              "data parallel: the whole model on every rank, gradients averaged", _UNIT)
TP = Strategy("tp", tensor_parallel.tensor_parallel, tensor_parallel.MESH,
              "tensor parallel: column/row-parallel matmuls, head-parallel attention, vocabulary-parallel "
              "embedding and loss, found from the ops' dimension rules", _UNIT)
HYBRID = Strategy("hybrid", tensor_parallel.tensor_parallel, tensor_parallel.HYBRID_MESH,
                  "tensor parallel inside units of tp= devices, data parallel across dp= units", _UNIT)
GPIPE = Strategy("gpipe", pipeline.named("gpipe"), pipeline.MESH,
                 "pipeline, GPipe schedule (all forwards, then all backwards); options pp, tp, dp, micro_batches",
                 _PIPELINE)
ONE_F_ONE_B = Strategy("1f1b", pipeline.named("1f1b"), pipeline.MESH,
                       "pipeline, 1F1B schedule; options pp, tp, dp, micro_batches", _PIPELINE)
INTERLEAVED = Strategy("interleaved", pipeline.named("interleaved"), pipeline.MESH,
                       "pipeline, interleaved 1F1B over virtual_stages chunks per rank; options pp, tp, dp, "
                       "micro_batches, virtual_stages", _PIPELINE)
ZERO_BUBBLE = Strategy("zero-bubble", pipeline.named("zero-bubble"), pipeline.MESH,
                       "pipeline, zero-bubble schedule (backward split into input and weight gradients)", _PIPELINE)
COSHARD = Strategy("coshard", tensor_parallel.coshard, tensor_parallel.MESH,
                   "tensor parallel with each device's piece of every split op run as chunks= pieces one after "
                   "another, recomputed in backward (less activation memory, same communication)",
                   _UNIT + ("chunks", "modules"))
PIPELINE = Strategy("pipeline", pipeline.pipeline, pipeline.MESH,
                    "pipeline with any schedule: schedule= a built-in name or your function fn(shape) -> per-rank "
                    "task lists; options pp, tp, dp, micro_batches, virtual_stages", _PIPELINE + ("schedule",))
INTERLACED = Strategy("interlaced", pipeline.interlaced_pipeline, pipeline.MESH,
                      "interlaced pipeline: layers in pp stages, the embedding and the LM head with its loss "
                      "tensor-parallel over every device, interlaced into the 1F1B order; options pp, tp, dp, "
                      "micro_batches", _UNIT)
MEGATRON = Strategy("megatron", pipeline.megatron, pipeline.MEGATRON_MESH,
                    "a Megatron-LM configuration: tp, cp, pp, dp, micro_batch_size or micro_batches, schedule, "
                    "virtual_stages, sequence_parallel, recompute, cp_comm (p2p, a2a, allgather), balance; "
                    "ep, etp and capacity_factor for mixture-of-experts models",
                    _PIPELINE + ("schedule", "cp_comm", "balance", "capacity_factor"))
AUTO = Strategy("auto", auto_search.auto, auto_search.MESH,
                "the fastest plan the search finds for the cluster (default: this machine) within its memory",
                ("memory_limit", "batch_statistics", "choose_compile", "choose_fp8"), mesh_after_capture=True)
ZERO1 = Strategy("zero1", data_parallel.zero_stage(1), data_parallel.MESH,
                 "data parallel with ZeRO stage 1: optimizer state sharded across the replicas", _UNIT)
ZERO2 = Strategy("zero2", data_parallel.zero_stage(2), data_parallel.MESH,
                 "data parallel with ZeRO stage 2: optimizer state and gradients sharded across the replicas", _UNIT)
ZERO3 = Strategy("zero3", data_parallel.zero_stage(3), data_parallel.MESH,
                 "data parallel with ZeRO stage 3: optimizer state, gradients and parameters sharded, parameters "
                 "gathered for forward and backward and freed in between", _UNIT)
EP = Strategy("ep", expert_parallel.expert_parallel, expert_parallel.MESH,
              "expert parallel: each MoE layer's experts split over ep= devices, tokens moved to them by "
              "all-to-all, each expert's width split over etp= devices; the dense part data-parallel inside the "
              "unit (tensor-parallel with tp=); dp= units",
              ("schedule", "recompute", "capacity_factor", "batch_statistics"))
CP = Strategy("cp", context_parallel.context_parallel, context_parallel.MESH,
              "context parallel: the sequence split over cp= devices, attention by cp_comm= ring (default), "
              "allgather or ulysses, causal load balancing by default; pp= pipeline stages of cp x tp devices",
              ("schedule", "virtual_stages", "cp_comm", "balance", "recompute", "batch_statistics"))
BUILTIN = (DP, TP, HYBRID, COSHARD, GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, PIPELINE, INTERLACED, MEGATRON, AUTO,
           ZERO1, ZERO2, ZERO3, EP, CP)


@hookimpl
def nnscaler_register_strategies() -> dict[str, Strategy]:
    return {s.name: s for s in BUILTIN}


__all__ = ["Strategy", "DP", "TP", "HYBRID", "COSHARD", "GPIPE", "ONE_F_ONE_B", "INTERLEAVED", "ZERO_BUBBLE", "PIPELINE",
           "INTERLACED", "MEGATRON", "AUTO", "ZERO1", "ZERO2", "ZERO3", "EP", "CP", "nnscaler_register_strategies"]


class _CallableModule(types.ModuleType):
    """Importing this subpackage binds `nnscaler_plugins.strategies` to it, which would hide the
    public function `nns.strategies()`; calling the module keeps that name working."""

    def __call__(self) -> list[str]:
        from nnscaler_plugins.plugins import strategies
        return strategies()


sys.modules[__name__].__class__ = _CallableModule
