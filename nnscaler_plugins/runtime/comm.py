"""`Comm`: what the generated code calls for communication (`_comm` in its source, passed by position).

Each call names a key the lowering gave the communication (`Program.reshards`, `grad_groups`,
`kernel_groups`) and this device's value; the object knows the Program, the device and its
replica's groups (`plan_groups.UnitGroups`). With a `recorder` (runtime/flight_recorder.py) each
call is also a position of the flight recorder (skipped inside torch.compile's tracing).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nnscaler_plugins.kernels.collectives import identity_fwd_allreduce_bwd
from nnscaler_plugins.runtime.flight_recorder import GRAD_SUM, KERNEL, RESHARD
from nnscaler_plugins.runtime.plan_groups import UnitGroups

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


class Comm:
    def __init__(self, program: Program, device: int, unit_groups: UnitGroups, recorder: Any = None):
        self.program = program
        self.device = device
        self.groups = unit_groups
        self.recorder = recorder

    def for_program(self, program: Program) -> "Comm":
        """The Comm a generated module's collectives index into: this one, or, for a program generated
        at other input sizes whose tables differ from this Program's (compiler/shapes.py), one over
        that program's own tables and the same process groups."""
        if program is self.program:
            return self
        cache = self.__dict__.setdefault("_others", {})
        if id(program) not in cache:
            cache[id(program)] = (program, Comm(program, self.device, self.groups, self.recorder))
        return cache[id(program)][1]

    def _own(self, groups: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        for g in groups:
            if self.device in g:
                return g
        raise RuntimeError(f"device {self.device} is in none of {groups}")

    def reshard(self, key: int, x: torch.Tensor) -> torch.Tensor:
        """Value `x` moved to the layout its consumer needs."""
        rec = self.recorder
        if rec is None or torch.compiler.is_compiling():
            return self.program.reshards[key].apply(x, self.device, self.groups)
        rec.enter(RESHARD, key)
        y = self.program.reshards[key].apply(x, self.device, self.groups)
        rec.leave()
        rec.backward_hook(RESHARD, key, y)
        return y

    def grad_sum(self, key: int, x: torch.Tensor) -> torch.Tensor:
        """Identity forward; backward sums the gradient over this device's group."""
        g = self._own(self.program.grad_groups[key])
        if len(g) == 1:
            return x
        y = identity_fwd_allreduce_bwd(x, self.groups.get(g))
        if self.recorder is not None and not torch.compiler.is_compiling():
            self.recorder.backward_hook(GRAD_SUM, key, y)
        return y

    def kernel(self, key: int) -> Any:
        """The process group a group-aware piece function communicates over. The recorder notes the op
        as entered: a hang inside it (a fused tensor-parallel matmul's chunked collectives, an experts
        all-to-all) is reported with its collective, ranks, op and source line; the next position
        recorded supersedes it."""
        if self.recorder is not None and not torch.compiler.is_compiling():
            self.recorder.enter(KERNEL, key)
        if key in self.program.replica_kernels:
            return self.replicas()
        return self.groups.get(self._own(self.program.kernel_groups[key]))

    def replicas(self) -> Any:
        """This device's copies in every data-parallel replica (the group gradients are averaged over)."""
        plan = self.program.plan
        first = self.groups.global_rank(0)  # unit-relative numbering of global ranks
        return self.groups.get(tuple(r * plan.unit_size + self.device - first for r in range(plan.dp)))
