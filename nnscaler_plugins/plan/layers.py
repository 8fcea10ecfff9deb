"""Repeated blocks of a graph: the transformer layers (or any `ModuleList` of blocks) and what
comes before and after them.

Pipeline stages are cut at block boundaries, and the search solves one block and reuses the answer
for its repeats, so both need the same reading of "the layers". It comes from the module paths
`torch.export` records: the `ModuleList` whose numbered children cover the most ops is the layer
stack (`transformer.h.3`, `model.layers.3`, `blocks.3`). Ops with no module of their own (a loss
computed in the top-level forward, say) belong with the ops around them.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from nnscaler_plugins.capture.graph import Graph, OpNode

_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass
class LayerGroups:
    """Ops split into the blocks before the layer stack, each layer, and the blocks after it."""

    prefix: str  # module path of the layer stack ("" when the model has none)
    pre: list[OpNode]
    layers: list[list[OpNode]]
    post: list[OpNode]

    def __len__(self) -> int:
        return len(self.layers)


def _stack_of(path: str) -> Optional[tuple[str, int]]:
    m = _INDEXED.match(path)
    return (m.group(1), int(m.group(2))) if m else None


def layer_groups(graph: Graph) -> LayerGroups:
    """Group the graph's ops by the repeated block they belong to (in graph order)."""
    stacks = Counter()
    for op in graph.ops:
        found = _stack_of(op.module_path)
        if found:
            stacks[found[0]] += 1
    if not stacks:
        return LayerGroups("", list(graph.ops), [], [])
    prefix = stacks.most_common(1)[0][0]
    index_of: list[Optional[int]] = []
    for op in graph.ops:
        found = _stack_of(op.module_path)
        index_of.append(found[1] if found and found[0] == prefix else None)
    known = [i for i in index_of if i is not None]
    first_pos = index_of.index(known[0])
    last_pos = len(index_of) - 1 - index_of[::-1].index(known[-1])
    numbers = sorted(set(known))
    layers: dict[int, list[OpNode]] = {n: [] for n in numbers}
    pre, post = list(graph.ops[:first_pos]), list(graph.ops[last_pos + 1:])
    current = known[0]
    for op, idx in zip(graph.ops[first_pos:last_pos + 1], index_of[first_pos:last_pos + 1]):
        if idx is not None:
            current = idx
        layers[current].append(op)  # ops without a module join the layer they sit in
    return LayerGroups(prefix, pre, [layers[n] for n in numbers], post)


def balanced_stages(groups: LayerGroups, num_stages: int,
                    weights: Optional[Sequence[float]] = None) -> list[list[OpNode]]:
    """Cut the layers into `num_stages` contiguous stages of (by weight) equal size; what comes
    before the layers joins the first stage and what comes after joins the last."""
    n = len(groups.layers)
    if num_stages < 1:
        raise ValueError("num_stages must be >= 1")
    if n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} pipeline stages; use at most {n} stages")
    w = list(weights) if weights is not None else [1.0] * n
    total = sum(w)
    cuts, acc, k = [], 0.0, 1
    for i, x in enumerate(w):
        acc += x
        remaining_layers, remaining_stages = n - i - 1, num_stages - k
        if k < num_stages and (acc >= total * k / num_stages or remaining_layers == remaining_stages):
            cuts.append(i + 1)
            k += 1
    bounds = [0] + cuts + [n]
    stages = [[op for layer in groups.layers[a:b] for op in layer] for a, b in zip(bounds, bounds[1:])]
    stages[0] = list(groups.pre) + stages[0]
    stages[-1] = stages[-1] + list(groups.post)
    return stages
