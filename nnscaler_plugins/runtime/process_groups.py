"""Process groups, created once per device set and shared by every ParallelModule in the process.

`torch.distributed.new_group` is itself a collective over the whole world: every rank must call it
for every set, members or not, in the same order. So the sets are created up front, sorted, before
any rank runs a step; creating one lazily from inside a forward would hang the ranks outside it.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch.distributed as dist

# (default group, device set) -> group. Keyed by the default group object itself, so a world torn
# down and set up again never sees the groups of the old one.
_CACHE: dict[tuple[Any, frozenset[int]], Any] = {}


def _world() -> Any:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group before building "
                           "process groups")
    return dist.group.WORLD


def _creation_order(sets: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    unique = {tuple(sorted(set(int(r) for r in s))) for s in sets}
    return sorted((s for s in unique if len(s) > 1), key=lambda s: (len(s), s))


class ProcessGroups:
    """The groups one ParallelModule needs, looked up by any ordering of their ranks."""

    def __init__(self, rank_sets: Iterable[Sequence[int]] = ()):
        self._world = _world()
        self._size = dist.get_world_size()
        self._rank = dist.get_rank()
        self._groups: dict[frozenset[int], Any] = {}
        self.ensure(rank_sets)

    def ensure(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """Create the groups not made yet. Collective: every rank passes the same sets."""
        for ranks in _creation_order(rank_sets):
            key = frozenset(ranks)
            if key in self._groups:
                continue
            if ranks[0] < 0 or ranks[-1] >= self._size:
                raise ValueError(f"group {list(ranks)} names ranks outside this world of {self._size}")
            if len(ranks) == self._size:
                self._groups[key] = self._world
                continue
            cached = _CACHE.get((self._world, key))
            if cached is None:
                cached = dist.new_group(ranks=list(ranks))
                _CACHE[(self._world, key)] = cached
            self._groups[key] = cached

    def adopt(self, rank_sets: Iterable[Sequence[int]], own: Any) -> None:
        """Take groups made elsewhere (a `DeviceMesh`'s, one per axis): `rank_sets` are every group of
        one axis, `own` this rank's group among them. Every rank adopts the same sets, so `ensure`
        skips them on every rank alike and the collective creation order stays the same."""
        for ranks in rank_sets:
            key = frozenset(int(r) for r in ranks)
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = own if self._rank in key else None

    def get(self, ranks: Sequence[int]) -> Optional[Any]:
        """The group of these ranks; None on ranks outside it and for a single rank (no peers)."""
        key = frozenset(int(r) for r in ranks)
        if len(key) <= 1 or self._rank not in key:
            return None
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"no process group for ranks {sorted(key)}: list it in the sets given to "
                           "ProcessGroups (or ensure()) on every rank before running") from None

    def __contains__(self, ranks: Sequence[int]) -> bool:
        return frozenset(ranks) in self._groups

    def __len__(self) -> int:
        return len(self._groups)
