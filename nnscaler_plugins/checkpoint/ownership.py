"""Which rank writes which whole tensor.

Every rank holds the same whole tensors after gathering, so any rank could write any of them;
giving each tensor to exactly one rank, largest first onto the rank with the fewest bytes so far,
spreads the writing evenly and stores every tensor once whatever the plan's replication.
"""
from __future__ import annotations

import heapq


def assign_owners(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """name -> rank; the same on every rank for the same sizes (ties broken by name, then rank)."""
    loads = [(0, r) for r in range(world_size)]
    heapq.heapify(loads)
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(loads)
        owners[name] = rank
        heapq.heappush(loads, (load + sizes[name], rank))
    return owners
