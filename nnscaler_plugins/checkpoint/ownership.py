"""Which rank writes which whole tensor.

Any rank can be made to hold any whole tensor, so any rank could write it; giving each tensor to
exactly one rank, largest first onto the rank with the fewest bytes so far, spreads the writing
evenly and stores every tensor once whatever the plan's replication. Model tensors are placed
first, then optimizer state continues from those loads (its sizes become known only once the
ranks have described their optimizers to each other); a rank keeps only the optimizer state it
owns, so saving never holds the whole optimizer state on one rank.
"""
from __future__ import annotations

import heapq
from typing import Any, Optional


def assign_owners(sizes: dict[Any, int], world_size: int, start: Optional[list[int]] = None) -> dict[Any, int]:
    """name -> rank; the same on every rank for the same sizes (ties broken by name, then rank).
    `start` is the bytes each rank already writes (tensors assigned in an earlier pass)."""
    loads = [(start[r] if start else 0, r) for r in range(world_size)]
    heapq.heapify(loads)
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], str(n))):
        load, rank = heapq.heappop(loads)
        owners[name] = rank
        heapq.heappush(loads, (load + sizes[name], rank))
    return owners


def loads(owners: dict[Any, int], sizes: dict[Any, int], world_size: int) -> list[int]:
    """Bytes each rank writes under `owners`."""
    out = [0] * world_size
    for name, rank in owners.items():
        out[rank] += sizes[name]
    return out
