"""The process groups a plan needs, and one data-parallel replica's view of them.

The plan's mesh comes first: a torch `DeviceMesh` with its named axes (dp, pp, tp, ...) gives one
group per axis, which users may hand to DTensor, FSDP or DCP (`ParallelModule.device_mesh`) and
which serve every set of the plan that is an axis's group (the replicas of a unit device are the
"dp" axis). Then every rank creates every other group, members or not, in one order (see
`process_groups.py`): the device sets the generated code communicates over, in every replica; the
whole unit (the step's loss and whole state dicts go to each of its devices); and the sets each
parameter's gradient is summed over (the reducers'). The generated code names devices relative to
its unit; `UnitGroups` turns them into this replica's global ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch.distributed as dist

from nnscaler_plugins.plan.mesh import Mesh
from nnscaler_plugins.runtime.process_groups import ProcessGroups

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program
    from nnscaler_plugins.plan.plan import Plan


class SingleProcess:
    """World size 1 needs no torch.distributed at all (and may run without it initialized)."""

    def get(self, ranks: tuple[int, ...]) -> None:
        return None

    def ensure(self, rank_sets: Any) -> None:
        pass


class UnitGroups:
    """Process groups of this data-parallel replica, addressed by unit-relative device tuples."""

    def __init__(self, groups: Union[ProcessGroups, SingleProcess], offset: int):
        self._groups = groups
        self._offset = offset

    def get(self, ranks: tuple[int, ...]) -> Any:
        return self._groups.get(tuple(self._offset + r for r in ranks))

    def global_rank(self, device: int) -> int:
        return self._offset + device


def replicas_of(plan: Plan, unit_group: tuple[int, ...]) -> tuple[int, ...]:
    """Global ranks of a unit device group in every data-parallel replica."""
    return tuple(sorted(dp * plan.unit_size + d for dp in range(plan.dp) for d in unit_group))


def step_rank_sets(program: Program) -> list[tuple[int, ...]]:
    """The rank sets a step communicates over: the generated code's, the unit's, the replicas'."""
    plan = program.plan
    out = []
    unit_sets = list(program.groups_needed())
    if plan.unit_size > 1:  # the step's loss and whole state dicts go to every device of the unit
        unit_sets.append(tuple(range(plan.unit_size)))
    for dp in range(plan.dp):
        off = dp * plan.unit_size
        out += [tuple(off + r for r in g) for g in unit_sets]
    if plan.dp > 1:  # replicas of each unit device, for gradient averaging
        for d in range(plan.unit_size):
            out.append(tuple(dp * plan.unit_size + d for dp in range(plan.dp)))
    return out


def reducer_rank_sets(program: Program) -> list[tuple[int, ...]]:
    """The rank sets gradients are summed over, for every device's shards (members or not)."""
    all_sets = set()
    for s in program.shards.values():
        for d in s.layout.group:
            ranks = replicas_of(program.plan, s.reduce_group(d))
            if len(ranks) > 1:
                all_sets.add(ranks)
    return sorted(all_sets, key=lambda g: (len(g), g))


# (default group, axis names, sizes, device type) -> DeviceMesh: one per mesh shape and world, shared
# by every ParallelModule of the process (making one is collective and creates a group per axis).
_MESHES: dict[tuple, Any] = {}


def device_mesh(mesh: Mesh, device_type: str) -> Any:
    """The torch `DeviceMesh` of a plan's mesh over the current world (collective on first use)."""
    key = (dist.group.WORLD, mesh.names, mesh.sizes, device_type)
    if key not in _MESHES:
        _MESHES[key] = mesh.device_mesh(device_type)
    return _MESHES[key]


def create_groups(program: Program, world_size: int,
                  device_type: str = "cpu") -> tuple[Union[ProcessGroups, SingleProcess], Optional[Any]]:
    """Every group the plan needs, created in one order (collective: every rank calls it), and the
    plan's DeviceMesh (None in one process)."""
    if world_size == 1:
        return SingleProcess(), None
    mesh = program.plan.mesh
    dm = device_mesh(mesh, device_type)
    groups = ProcessGroups()
    for name, size in zip(mesh.names, mesh.sizes):
        if size > 1:
            groups.adopt(mesh.groups([name]), dm.get_group(name))
    groups.ensure(step_rank_sets(program))
    groups.ensure(reducer_rank_sets(program))
    return groups, dm
