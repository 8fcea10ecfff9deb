"""`deepspeed.pipe.PipelineModule`, `LayerSpec` and `TiedLayerSpec` under DeepSpeed 0.19's
signatures, run by this project's plans.

DeepSpeed builds only its own stage's layers on each rank and moves activations between stages
itself. Here the whole sequence of layers is one model (every rank builds every layer, in order, so
with `seed_layers=True` each layer's initial weights are DeepSpeed's, layer `i` drawn after
`seed_fn(base_seed + i)`); its forward is the layers one after the other and, given labels,
`loss_fn(outputs, labels)`. The engine picks a pipeline plan of `num_stages` stages for it
(`1f1b`, unless the config's nnscaler section names a plan) and `engine.train_batch()` runs
DeepSpeed's step: gradient_accumulation_steps micro-batches `(inputs, labels)` and one optimizer
step. Where the stage boundaries fall is the plan's, which changes no result.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from .errors import DeepSpeedConfigError

#: The partition methods accepted: both only move stage boundaries, which the plan places.
PARTITION_METHODS = ("parameters", "uniform")


class LayerSpec:
    """A layer given as its class and constructor arguments, built when the PipelineModule is."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        if not issubclass(typename, nn.Module):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer built once per `key` and used at every place the key appears (an embedding reused as
    the output projection): one module, so its weights are one parameter, as DeepSpeed keeps them
    equal by reducing their gradients together."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class PipelineModule(nn.Module):
    """DeepSpeed's pipeline model: a sequence of layers (modules, LayerSpecs, TiedLayerSpecs or
    callables) and the loss the last one's output is scored with. Layer `i`'s parameters are
    `layers.<i>.<name>` (DeepSpeed's `<i>.<name>` under `layers`: the numbered blocks the pipeline
    plan cuts into stages), tied ones `tied_modules.<key>.<name>` as in DeepSpeed."""

    def __init__(self, layers: Any, num_stages: Optional[int] = None, topology: Any = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if topology is not None:
            raise DeepSpeedConfigError("PipelineModule(topology=...) is not supported: the plan decides the process "
                                       "grid; pass num_stages= (and pick data or tensor parallelism in the config's "
                                       "nnscaler section)")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise DeepSpeedConfigError(f"PipelineModule(num_stages={num_stages!r}): give a positive number of stages")
        if partition_method.lower() not in PARTITION_METHODS:
            raise DeepSpeedConfigError(
                f"PipelineModule(partition_method={partition_method!r}) is not supported: the plan places the stage "
                f"boundaries (balanced by its cost model); use {' or '.join(map(repr, PARTITION_METHODS))}")
        if activation_checkpoint_interval:
            raise DeepSpeedConfigError(
                f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}) is not supported: "
                "recompute activations with the plan's option instead, 'nnscaler': {'plan': '1f1b', 'recompute': ...}")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.dynamic_shape = dynamic_shape
        self.layers = nn.ModuleDict()
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict = {}
        self.forward_funcs: list = []
        self._layer_specs = list(layers)
        for idx, layer in enumerate(self._layer_specs):
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, nn.Module):
                self.layers[str(idx)] = layer
                self.forward_funcs.append(layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.layers[str(idx)] = module
                self.forward_funcs.append(module)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise DeepSpeedConfigError(f"PipelineModule layer {idx} is a {type(layer).__name__}: give a module, "
                                           "a LayerSpec, a TiedLayerSpec or a callable")

    def forward(self, forward_input: Any, labels: Any = None) -> Any:
        """The layers in order on `forward_input`; with `labels`, `loss_fn(outputs, labels)` (what
        DeepSpeed's last stage computes)."""
        x = forward_input
        for fn in self.forward_funcs:
            x = fn(x)
        if labels is None:
            return x
        if self.loss_fn is None:
            raise DeepSpeedConfigError("PipelineModule has no loss_fn, so train_batch cannot score its outputs; pass "
                                       "loss_fn= (e.g. torch.nn.CrossEntropyLoss())")
        return self.loss_fn(x, labels)

    def topology(self) -> None:
        return None

    def num_pipeline_stages(self) -> int:
        return self.num_stages




def pipeline_call(batch: Any) -> tuple:
    """A batch of DeepSpeed's pipeline data iterators, `(inputs, labels)`, as the positional
    arguments of `PipelineModule.forward` (which scores the outputs with `loss_fn`)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise DeepSpeedConfigError(f"a PipelineModule's train_batch / eval_batch takes batches (inputs, labels) from "
                                   f"data_iter, as DeepSpeed's PipelineEngine does; got a {type(batch).__name__}"
                                   + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    return tuple(batch)


def pipeline_plan(module: PipelineModule, plan: Any, options: dict, named: bool) -> tuple[Any, dict]:
    """The plan a PipelineModule runs under: the config's nnscaler section when it names one (its
    pipeline degree, if any, must be num_stages), else `1f1b` with `pp=num_stages` (data parallel
    for one stage)."""
    if not named:
        return ("1f1b", dict(options, pp=module.num_stages)) if module.num_stages > 1 else (plan, options)
    pp = options.get("pp")
    if pp is not None and pp != module.num_stages:
        raise DeepSpeedConfigError(f"PipelineModule(num_stages={module.num_stages}) but the config's nnscaler section "
                                   f"says pp={pp}; give one number of stages (or leave pp out)")
    return plan, options
