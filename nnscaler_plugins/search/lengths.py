"""Pricing plans for the lengths a job really sees, not only the example's.

A plan runs at any sequence length (runtime/batch_shapes.py), but its cost does not scale alike
everywhere: attention grows with the square of the length, activations with the length, weights
not at all. A search therefore takes `lengths=`: one representative length (the model is captured
at it instead of the example's), or a histogram `{length: weight}` of the lengths the data holds.
With a histogram the plans are searched at the weighted mean length, then each plan on the
frontier is simulated at every length of the histogram: its step time is the weighted mean (what
an epoch costs per step), its memory the largest peak (what the longest batch needs), and the
frontier is taken again on those.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, Union

import torch
import torch.utils._pytree as pytree

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.search.simulator import Estimate

Lengths = Union[int, Sequence[int], Mapping[int, float]]
MAX_BINS = 8  # each length is one capture; longer histograms are merged into this many bins


def histogram(lengths: Lengths) -> list[tuple[int, float]]:
    """(length, weight) pairs, weights summing to 1, at most MAX_BINS of them."""
    if isinstance(lengths, int):
        pairs = [(lengths, 1.0)]
    elif isinstance(lengths, Mapping):
        pairs = [(int(k), float(v)) for k, v in lengths.items()]
    else:
        counts: dict[int, float] = {}
        for n in lengths:
            counts[int(n)] = counts.get(int(n), 0.0) + 1.0
        pairs = list(counts.items())
    pairs = sorted((n, w) for n, w in pairs if w > 0)
    if not pairs or any(n < 1 for n, _ in pairs):
        raise PlanError(f"lengths= must be a length >= 1, a list of lengths or a {{length: weight}} histogram "
                          f"with positive weights (got {lengths!r})")
    if len(pairs) > MAX_BINS:  # equal-weight bins, each priced at its weighted mean length
        total, target = sum(w for _, w in pairs), sum(w for _, w in pairs) / MAX_BINS
        merged, acc, acc_w = [], 0.0, 0.0
        for n, w in pairs:
            acc, acc_w = acc + n * w, acc_w + w
            if acc_w >= target - 1e-12:
                merged.append((round(acc / acc_w), acc_w))
                acc, acc_w = 0.0, 0.0
        if acc_w:
            merged.append((round(acc / acc_w), acc_w))
        pairs = merged
    total = sum(w for _, w in pairs)
    return [(n, w / total) for n, w in pairs]


def representative(pairs: Sequence[tuple[int, float]]) -> int:
    return max(1, round(sum(n * w for n, w in pairs)))


def at_length(inputs: Any, length: int) -> Any:
    """The example inputs with their sequence dim set to `length`: dim 1 of every token-like input
    (integer or bool, 2+ dims) as long as the first one, tiled or cut (values do not matter to a
    capture, which traces with fake tensors)."""
    leaves = pytree.tree_leaves(inputs)
    tokens = [x for x in leaves if isinstance(x, torch.Tensor) and x.ndim >= 2
              and not x.dtype.is_floating_point and not x.dtype.is_complex]
    if not tokens:
        raise PlanError("lengths= needs token-like inputs (integer tensors of shape [batch, length, ...]); these "
                          "inputs have none: capture the model at the length you want instead")
    old = tokens[0].shape[1]

    def resize(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[1] != old:
            return x
        if x.dtype.is_floating_point or x.dtype.is_complex:
            return x
        reps = [1] * x.ndim
        reps[1] = -(-length // old)
        return x.repeat(*reps)[:, :length]

    return pytree.tree_map(resize, inputs)


def price_over_lengths(plans: Sequence[Plan], pairs: Sequence[tuple[int, float]],
                       graph_at: Callable[[Plan, int], Graph], simulate: Callable[[Plan, Graph], Estimate]
                       ) -> list[Estimate]:
    """Each plan's estimate over the histogram (see the module docstring)."""
    out = []
    for plan in plans:
        per = []
        for n, w in pairs:
            g = graph_at(plan, n)
            per.append((n, w, simulate(dataclasses.replace(plan, graph_fingerprint=g.fingerprint()), g)))
        out.append(combine(per))
    return out


def combine(per: Sequence[tuple[int, float, Estimate]]) -> Estimate:
    """Weighted mean times, largest peaks; the breakdown is the longest length's."""
    mean = lambda f: sum(w * f(e) for _, w, e in per)  # noqa: E731
    longest = max(per, key=lambda p: p[0])[2]
    peaks = [max(col) for col in zip(*(e.peak_memory_bytes for _, _, e in per))]
    details = dict(longest.details)
    details["lengths"] = {n: {"weight": w, "step_time_s": e.step_time_s, "max_memory_bytes": e.max_memory_bytes}
                          for n, w, e in per}
    return Estimate(mean(lambda e: e.step_time_s), mean(lambda e: e.compute_s), mean(lambda e: e.communication_s),
                    mean(lambda e: e.bubble_s), peaks, dict(longest.memory), longest.micro_batches,
                    longest.world_size, mean(lambda e: e.flops_per_device), longest.cluster, details)
