"""Under ZeRO-3, the model's parameters hold no values from `initialize` on, as DeepSpeed's do.

DeepSpeed partitions a ZeRO-3 model's parameters in `initialize`: from then on `param.data` is an
empty tensor, `param.ds_*` describe the whole one, and `zero.GatheredParameters` gives it values.
Scripts and DeepSpeed's own tests rely on that before the first forward too (compare two engines'
parameters, load a checkpoint and look at it, gather to initialize). This engine parallelizes the
model at the first forward (it needs example inputs), so until then `HeldParameters` keeps each
parameter's whole values aside and leaves the parameter empty and marked; `whole()` puts them back
for the engine's own use of the model (capture, checkpoints, initialization).

A model built under zero.Init has meta parameters, which cannot take values in place: each is
replaced, wherever the model registers it, by an empty real parameter carrying its attributes;
the meta one is kept aside (and registered again inside `whole()`, where initializing the model
makes it real).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .zero import mark_partitioned


def register_in_place_of(model: torch.nn.Module, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """Put `new` wherever `model` (and its submodules) registers `old`."""
    for module in model.modules():
        for leaf, q in list(module._parameters.items()):
            if q is old:
                module._parameters[leaf] = new


class HeldParameters:
    """The whole values of a ZeRO-3 model's parameters before it is parallelized."""

    def __init__(self, model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                 shapes: dict[str, torch.Size], names: dict[int, str]):
        """`params` (name -> the parameter scripts see) and `names` (id -> name) are the engine's,
        updated here where a meta parameter gets a stand-in."""
        self._model = model
        self._visible = params
        self._values: dict[str, object] = {}  # name -> whole tensor, or the model's own meta Parameter
        for name, p in list(params.items()):
            if p.is_meta:
                stand_in = torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                for k, v in vars(p).items():
                    setattr(stand_in, k, v)
                register_in_place_of(model, p, stand_in)
                self._values[name] = p
                params[name] = stand_in
                names[id(stand_in)] = name
            else:
                self._values[name] = p.data
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            mark_partitioned(params[name], shapes[name])

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """The model's parameters whole inside (the meta ones of a zero.Init model registered back
        until it is initialized); empty again after, keeping what was written into them."""
        for name, value in self._values.items():
            p = self._visible[name]
            if isinstance(value, torch.nn.Parameter):
                register_in_place_of(self._model, p, value)
            else:
                p.data = value
        try:
            yield
        finally:
            for name, value in self._values.items():
                p = self._visible[name]
                if isinstance(value, torch.nn.Parameter):
                    register_in_place_of(self._model, value, p)
                else:
                    self._values[name] = p.data
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def value(self, name: str) -> torch.Tensor:
        """The whole values of parameter `name` (call inside `whole()` after the model was
        initialized: a meta parameter has none)."""
        value = self._values[name]
        return value.data if isinstance(value, torch.nn.Parameter) else value

    def is_kept(self, param: torch.Tensor) -> bool:
        """Whether `param` is a zero.Init model's own meta Parameter this keeps aside."""
        return any(v is param for v in self._values.values())
