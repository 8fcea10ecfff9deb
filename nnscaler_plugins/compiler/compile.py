"""The compile stage: a plan on a graph becomes one artifact per device of the plan's unit.

    compiled = compile_program(graph, plan, model=model)      # lowers once for the whole unit
    artifact = compiled.artifact(rank % plan.unit_size)      # generates, writes and imports one file

Lowering is computed identically for every device, so every rank knows every process group its
peers create; code is generated only for the devices asked for (a rank needs its own), and cached
under a key covering the graph, the model's source, the plan and the library (codegen/generate.py).
The model, when given, is kept only as a weightless copy on the meta device, from which programs for
other input sizes are captured when a batch needs one (`shapes.ShapePrograms`).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.capture.skeleton import meta_skeleton
from nnscaler_plugins.codegen.generate import read_source, write_and_load
from nnscaler_plugins.compiler.artifact import Artifact
from nnscaler_plugins.compiler.loss_items import LossItems
from nnscaler_plugins.compiler.regions import RegionLog, compile_regions
from nnscaler_plugins.compiler.shapes import ShapePrograms
from nnscaler_plugins.lower.lowering import Program, lower
from nnscaler_plugins.plan.plan import Plan

DEFAULT_CACHE_DIR = ".nnscaler_cache"


class Compiled:
    """A plan lowered for its whole unit; `artifact(d)` is device d's runnable part."""

    def __init__(self, program: Program, skeleton: Optional[torch.nn.Module], cache_dir: str,
                 why_no_skeleton: str = "", lower_seconds: float = 0.0):
        self.program = program
        self.skeleton = skeleton
        self.cache_dir = cache_dir
        self.why_no_skeleton = why_no_skeleton
        self.lower_seconds = lower_seconds
        self._artifacts: dict[tuple[int, Optional[str]], Artifact] = {}

    @property
    def plan(self) -> Plan:
        return self.program.plan

    @property
    def graph(self) -> Graph:
        return self.program.graph

    @property
    def unit_size(self) -> int:
        return self.program.unit_size

    def artifact(self, unit_device: int, compile_backend: Optional[str] = None) -> Artifact:
        """Device `unit_device`'s artifact (a global rank's is `artifact_for_rank(rank)`), made once.

        Under the plan's `compile` knob its regions run under torch.compile (compiler/regions.py).
        `compile_backend` asks for that whatever the knob says, with this backend: what
        `ParallelModule.compile()` and `engine.compile()` use on a module made without it."""
        if not 0 <= unit_device < self.unit_size:
            raise ValueError(f"device {unit_device} is outside the plan's unit of {self.unit_size} devices")
        knobs = self.plan.knobs
        backend = compile_backend or (knobs.compile_backend if knobs.compile else None)
        key = (unit_device, backend)
        if key not in self._artifacts:
            start = time.perf_counter()
            regions = backend is not None
            module, path = write_and_load(self.program, unit_device, self.cache_dir, regions)
            source = read_source(path)
            log = RegionLog()
            label = f"{self.graph.model_class} (device {unit_device})"

            def compiled(mod: Any, dynamic: bool) -> None:
                if backend is not None:
                    compile_regions(mod, backend=backend, dynamic=dynamic, label=label, log=log)
            compiled(module, False)
            shapes = ShapePrograms(self.program, unit_device, module, source, self.skeleton, self.cache_dir,
                                   self.why_no_skeleton, regions=regions, compile_module=compiled)
            art = Artifact(self.program, unit_device, module, path, shapes,
                           LossItems(self.graph, self.program.loss_index),
                           compile_seconds=self.lower_seconds + time.perf_counter() - start,
                           compile_backend=backend, region_log=log)
            art.with_compile = lambda b, d=unit_device: self.artifact(d, b or knobs.compile_backend)
            self._artifacts[key] = art
        return self._artifacts[key]

    def artifact_for_rank(self, rank: int) -> Artifact:
        """The artifact global rank `rank` runs: its device in the unit (`rank % unit_size`)."""
        return self.artifact(rank % self.unit_size)

    def artifacts(self) -> list[Artifact]:
        """Every device's artifact, in device order (generates every file; for inspection and tests)."""
        return [self.artifact(d) for d in range(self.unit_size)]

    def __repr__(self) -> str:
        return (f"<Compiled {self.graph.model_class}: {self.plan.strategy} over {self.unit_size} device(s) x "
                f"{self.plan.dp} replica(s), {len(self.program.groups_needed())} process groups>")


def compile_program(graph: Graph, plan: Plan, *, model: Any = None, program: Optional[Program] = None,
                    cache_dir: str = DEFAULT_CACHE_DIR) -> Compiled:
    """Lower `plan` on `graph` (or take the `program` already lowered from them) for the compile
    stage. `model` (the captured module) lets batches of other sizes be served by programs captured
    again from its weightless copy; without it only the example's sizes run."""
    start = time.perf_counter()
    if program is None:
        program = lower(graph, plan)
    took = time.perf_counter() - start
    skeleton, why = None, ""
    if isinstance(model, torch.nn.Module):
        skeleton = meta_skeleton(model)
        why = "" if skeleton is not None else "the model could not be copied for another capture"
    else:
        why = "the module was compiled without the model"
    return Compiled(program, skeleton, cache_dir, why, took)
