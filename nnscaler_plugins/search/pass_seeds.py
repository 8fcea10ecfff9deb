"""The search's starting points, made by the same passes the strategies compose.

Tensor parallelism, its sequence-parallel norms and context parallelism are derived once, in
`nnscaler_plugins.passes`; the intra-op search starts from what those passes choose for a device
group (`IntraSolver.seeds`) and then improves it by pricing. Each function runs the pass on a
throwaway builder over the ops the solver looks at (its window: the ops before the layers, two
layers, the ops after them) and returns, per op, the label (and block factor) it splits along.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import Parallelization, Stage, apply_sp, check_context_parallel, sequence_choices
from nnscaler_plugins.passes.tensor_parallel import TensorParallelPropagation
from nnscaler_plugins.plan.mesh import Mesh
from nnscaler_plugins.plan.primitives import PlanBuilder

Split = tuple[str, int]  # (label, block factor)


class PassSeeds:
    """Per graph and window: the passes' choices for a device group of each size, computed once."""

    def __init__(self, graph: Graph, window: Sequence[OpNode]):
        self.graph = graph
        self.window = [op.name for op in window]
        self._builders: dict[tuple[str, int], PlanBuilder] = {}

    def _builder(self, axis: str, degree: int) -> PlanBuilder:
        key = (axis, degree)
        if key not in self._builders:
            self._builders[key] = PlanBuilder(self.graph, mesh=Mesh(("dp", axis), (1, degree)), strategy="search")
        return self._builders[key]

    def _window_ops(self, builder: PlanBuilder) -> list:
        wanted = set(self.window)
        return [op for op in builder.ops if op.name in wanted]

    @functools.lru_cache(maxsize=16)
    def tensor_parallel(self, degree: int) -> dict[str, Split]:
        """What `passes.apply_tp` splits over `degree` devices (the ops it runs whole are left out)."""
        if degree <= 1:
            return {}
        b = self._builder("tp", degree)
        ops = self._window_ops(b)
        choices = TensorParallelPropagation(b, degree=degree, ops=ops if len(ops) < len(b.ops) else None).run()
        return {name: (c.label, c.block) for name, c in choices.items() if c.label is not None}

    @functools.lru_cache(maxsize=16)
    def sequence_parallel(self, degree: int) -> dict[str, Split]:
        """The ops `passes.apply_sp` splits along the sequence on top of `tensor_parallel(degree)`."""
        tp = self.tensor_parallel(degree)
        if not tp:
            return {}
        b = self._builder("tp", degree)
        par = Parallelization(b)
        by_name = {op.name: op for op in b.ops}
        for name, (label, block) in tp.items():
            par.split(by_name[name], "tp", label, block)
        wanted = set(self.window)
        if len(wanted) < len(b.ops):  # the window only (one stage of it): ops outside it are not looked at
            par.stages = [Stage(tuple(op for op in b.ops if op.name in wanted), 0)]
        apply_sp(par)
        return {name: (s["tp"].label, s["tp"].block) for name, s in par.splits.items()
                if name not in tp and "tp" in s}

    @functools.lru_cache(maxsize=16)
    def context_parallel(self, degree: int, balanced: bool) -> Optional[dict[str, Split]]:
        """What `passes.apply_cp` splits along the sequence over `degree` devices (None where the
        pass refuses context parallelism for this graph)."""
        if degree <= 1:
            return {}
        b = self._builder("cp", degree)
        try:
            length = check_context_parallel(b, degree, "ring", balanced)
        except PlanError:
            return None
        found = sequence_choices(b, degree, length, -2 if balanced else 1)
        return {name: split for name, split in found.items() if split is not None}
