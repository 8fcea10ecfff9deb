"""The built-in strategies, shipped as a plugin exactly like a third-party package would ship one.

The core finds this module through the `nnscaler_plugins` entry point and never imports it, so a
strategy written outside this repository has the same standing as these.

Registration: each strategy is registered as a `Strategy` object. It is callable like any
strategy (`strategy(builder, **options)`), and it also carries `degrees(world_size, **options) ->
(unit_size, dp)`, which `nns.plan` asks before it makes the builder, and `options`, the names of
the options it takes, which every entry point checks before anything starts (a misspelt `tpp=2`
is refused naming `tp`; the training knobs in `nnscaler_plugins.plan.source.COMMON_OPTIONS` -- zero,
precision, micro_batches, micro_batch_size, cluster, constraints -- are valid for every strategy
and not listed). A plain function with `.degrees` and `.options` attributes works the same for
third-party plugins (without `.options`, its keyword parameters are its options; see
`nnscaler_plugins.plan.source.strategy_options`); the object exists so that the name and a one-line
description travel with the strategy (for `nns.strategies()`-style listings).

    dp           every rank runs the whole model on its own batch (unit of 1 device, dp = world)
    tp           Megatron-style tensor parallelism over the whole world (or tp= devices, dp = world / tp)
    hybrid       tp= devices per unit, dp= units
    coshard      tp whose split ops run chunks= pieces per device in turn, recomputed in backward
    gpipe, 1f1b, interleaved, zero-bubble
                 pipelines of pp stages (x tp, x dp) with that schedule
    pipeline     the same with schedule= any built-in name or a function of your own
    interlaced   layers pipelined, embedding and LM head tensor-parallel over all devices
    megatron     tp x pp x dp with Megatron's options
    zero1, zero2, zero3
                 dp with that ZeRO stage (every strategy also takes zero= and precision=)
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nnscaler_plugins.hookspecs import hookimpl
from nnscaler_plugins.plan.primitives import PlanBuilder

from . import auto as auto_search
from . import context_parallel, data_parallel, expert_parallel, hybrid, pipeline, tensor_parallel, zero


@dataclass(frozen=True)
class Strategy:
    """A named strategy: `apply(builder, **options)` plus the degrees it wants for a world size."""

    name: str
    apply: Callable[..., None]
    degrees: Callable[..., tuple[int, int]]
    doc: str = ""
    # The options it takes besides those every strategy takes; None: those of `apply` (its keyword
    # parameters, unchecked if it takes **options), see nnscaler_plugins.plan.source.strategy_options.
    options: Optional[tuple[str, ...]] = None

    def __call__(self, builder: PlanBuilder, **options: Any) -> None:
        self.apply(builder, **options)

    def __repr__(self) -> str:
        return f"<strategy {self.name}: {self.doc}>"


# Options each strategy reads (its apply function and its degrees); zero, precision, micro_batches,
# micro_batch_size, cluster and constraints are every strategy's and not repeated here.
_UNIT = ("tp", "dp", "recompute", "batch_statistics")
_PIPELINE = ("pp", "tp", "dp", "virtual_stages", "recompute", "sequence_parallel", "batch_statistics")

DP = Strategy("dp", data_parallel.data_parallel, data_parallel.degrees,
              "data parallel: the whole model on every rank, gradients averaged", _UNIT)
TP = Strategy("tp", tensor_parallel.tensor_parallel, tensor_parallel.degrees,
              "tensor parallel: column/row-parallel matmuls, head-parallel attention, vocabulary-parallel "
              "embedding and loss, found from the ops' dimension rules", _UNIT)
HYBRID = Strategy("hybrid", hybrid.hybrid, hybrid.degrees,
                  "tensor parallel inside units of tp= devices, data parallel across dp= units", _UNIT)


GPIPE = Strategy("gpipe", pipeline.gpipe, pipeline.degrees,
                 "pipeline, GPipe schedule (all forwards, then all backwards); options pp, tp, dp, micro_batches",
                 _PIPELINE)
ONE_F_ONE_B = Strategy("1f1b", pipeline.one_f_one_b, pipeline.degrees,
                       "pipeline, 1F1B schedule; options pp, tp, dp, micro_batches", _PIPELINE)
INTERLEAVED = Strategy("interleaved", pipeline.interleaved, pipeline.degrees,
                       "pipeline, interleaved 1F1B over virtual_stages chunks per rank; options pp, tp, dp, "
                       "micro_batches, virtual_stages", _PIPELINE)
ZERO_BUBBLE = Strategy("zero-bubble", pipeline.zero_bubble, pipeline.degrees,
                       "pipeline, zero-bubble schedule (backward split into input and weight gradients)", _PIPELINE)
COSHARD = Strategy("coshard", tensor_parallel.coshard, tensor_parallel.degrees,
                   "tensor parallel with each device's piece of every split op run as chunks= pieces one after "
                   "another, recomputed in backward (less activation memory, same communication)",
                   _UNIT + ("chunks", "modules"))
PIPELINE = Strategy("pipeline", pipeline.pipeline, pipeline.degrees,
                    "pipeline with any schedule: schedule= a built-in name or your function fn(shape) -> per-rank "
                    "task lists; options pp, tp, dp, micro_batches, virtual_stages", _PIPELINE + ("schedule",))
INTERLACED = Strategy("interlaced", pipeline.interlaced_pipeline, pipeline.degrees,
                      "interlaced pipeline: layers in pp stages, the embedding and the LM head with its loss "
                      "tensor-parallel over every device, interlaced into the 1F1B order; options pp, tp, dp, "
                      "micro_batches", ("pp", "tp", "dp", "recompute", "batch_statistics"))
MEGATRON = Strategy("megatron", pipeline.megatron, pipeline.megatron_degrees,
                    "a Megatron-LM configuration: tp, pp, dp, micro_batch_size or micro_batches, schedule, "
                    "virtual_stages, sequence_parallel, recompute", _PIPELINE + ("schedule",))
AUTO = Strategy("auto", auto_search.auto, auto_search.degrees,
                "the fastest plan the search finds for the cluster (default: this machine) within its memory",
                ("dp", "memory_limit", "batch_statistics"))
ZERO1 = Strategy("zero1", zero.zero_stage(1), zero.degrees,
                 "data parallel with ZeRO stage 1: optimizer state sharded across the replicas", _UNIT)
ZERO2 = Strategy("zero2", zero.zero_stage(2), zero.degrees,
                 "data parallel with ZeRO stage 2: optimizer state and gradients sharded across the replicas", _UNIT)
ZERO3 = Strategy("zero3", zero.zero_stage(3), zero.degrees,
                 "data parallel with ZeRO stage 3: optimizer state, gradients and parameters sharded, parameters "
                 "gathered for forward and backward and freed in between", _UNIT)
EP = Strategy("ep", expert_parallel.expert_parallel, expert_parallel.degrees,
              "expert parallel: each MoE layer's experts split over ep= devices, tokens moved to them by "
              "all-to-all, each expert's width split over etp= devices; the dense part data-parallel inside the "
              "unit (tensor-parallel with tp=); dp= units",
              ("ep", "etp", "dp", "tp", "pp", "schedule", "recompute", "capacity_factor", "batch_statistics"))
CP = Strategy("cp", context_parallel.context_parallel, context_parallel.degrees,
               "context parallel: the sequence split over cp= devices, attention by cp_comm= ring (default), "
               "allgather or ulysses, causal load balancing by default; pp= pipeline stages of cp x tp devices",
               ("cp", "dp", "tp", "pp", "schedule", "virtual_stages", "cp_comm", "balance", "recompute",
                "batch_statistics"))
BUILTIN = (DP, TP, HYBRID, COSHARD, GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, PIPELINE, INTERLACED, MEGATRON, AUTO,
           ZERO1, ZERO2, ZERO3, EP, CP)


@hookimpl
def nnscaler_register_strategies() -> dict[str, Strategy]:
    return {s.name: s for s in BUILTIN}


__all__ = ["Strategy", "DP", "TP", "HYBRID", "COSHARD", "GPIPE", "ONE_F_ONE_B", "INTERLEAVED", "ZERO_BUBBLE", "PIPELINE", "INTERLACED",
           "MEGATRON", "ZERO1", "ZERO2", "ZERO3",
           "nnscaler_register_strategies"]


class _CallableModule(types.ModuleType):
    """Importing this subpackage binds `nnscaler_plugins.strategies` to it, which would hide the
    public function `nns.strategies()`; calling the module keeps that name working."""

    def __call__(self) -> list[str]:
        from nnscaler_plugins.plugins import strategies
        return strategies()


sys.modules[__name__].__class__ = _CallableModule
