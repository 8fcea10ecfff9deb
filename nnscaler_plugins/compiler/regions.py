"""torch.compile over a generated module's compiled regions (codegen/regions.py).

A module generated with the plan's `compile` knob lists its region functions in `REGIONS`; here
each is replaced, in the module's namespace, by `torch.compile` of it, so the stage functions that
call them by name run them compiled while their collectives stay eager between them. torch.compile
caches per code object: each region compiles once for every layer that calls it, and again only
for inputs of other shapes, dtypes or grad mode.

The file generated for the example's sizes is compiled with static shapes. The file fitted for
every size (compiler/shapes.py) reads its sizes from `_S`, which each region takes as an argument:
it is compiled with `dynamic=True`, so the sizes and the lengths of the inputs are symbols and one
graph serves every length (torch specializes sizes 0 and 1, and sizes equal to another when first
seen, so such a batch may add one more graph).

Compilation happens at a region's first call, inside the first step. That call is timed, shown
on a progress line when it takes a while ("torch.compile LlamaForCausalLM _r3: done in 14.2 s"),
and recorded in `RegionLog`. Inductor is asked for eager's random numbers (`fallback_random`), so
dropout draws the masks it draws without compile and results stay those of the uncompiled plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nnscaler_plugins.progress import phase


@dataclass
class RegionLog:
    """Seconds each region's first call took (compilation included), in the order they ran."""

    first_calls: list[tuple[str, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.first_calls)


def compile_regions(module: Any, *, backend: str, dynamic: bool, label: str, log: RegionLog) -> int:
    """Put torch.compile of each of `module`'s regions in its place (once per module); returns how
    many regions it has."""
    names = tuple(getattr(module, "REGIONS", ()))
    done = getattr(module, "_nns_compiled_as", None)
    if done is not None:
        if done != (backend, dynamic):
            raise RuntimeError(f"{module.__name__} is already compiled with {done}; one process compiles one plan's "
                               "file one way")
        return len(names)
    options: dict[str, Any] = {"backend": backend, "dynamic": dynamic}
    if backend == "inductor":
        options["options"] = {"fallback_random": True}
    for name in names:
        fn = getattr(module, name)
        setattr(module, name, _FirstCall(module, name, torch.compile(fn, **options), label, log))
    module._nns_compiled_as = (backend, dynamic)
    return len(names)


class _FirstCall:
    """A compiled region until its first call returns: that call is timed and shown, then the
    module calls the compiled function directly."""

    def __init__(self, module: Any, name: str, compiled: Callable, label: str, log: RegionLog):
        self.module, self.name, self.compiled, self.label, self.log = module, name, compiled, label, log

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        with phase(f"torch.compile {self.label} {self.name}"):
            out = self.compiled(*args)
        self.log.first_calls.append((self.name, time.perf_counter() - start))
        setattr(self.module, self.name, self.compiled)
        return out
