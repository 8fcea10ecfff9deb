"""What a piece of a grouped expert matmul runs when the experts are split among the pieces.

A grouped matmul multiplies consecutive groups of rows by one expert's weight each: rows
[offs[e-1], offs[e]) by weight[e] (the rows arrive sorted by expert). A piece holding experts
[first, first + E_local) computes exactly the rows of its experts and leaves the other rows zero,
so the pieces' outputs add up to the whole output (every row belongs to one expert). The rows a
piece owns depend on the data (the offsets); the zeros keep every piece's output the full shape,
which is what lets expert parallelism be read as a partial sum over the expert dim.
"""
from __future__ import annotations

import torch


def _op(name: str):
    """An op overload from its table key: 'transformers.grouped_mm_fallback.default'."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def expert_slice_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int,
                            op: str) -> torch.Tensor:
    """Rows of experts [first, first + weight.shape[0]) multiplied by their experts; zeros elsewhere.

    `offs` is the whole (cumulative) offsets tensor; `op` the grouped matmul to run on the slice.
    """
    local = weight.shape[0]
    bounds = offs.tolist()
    start = int(bounds[first - 1]) if first > 0 else 0
    end = int(bounds[first + local - 1])
    part = _op(op)(input[start:end], weight, offs[first:first + local] - start)
    return torch.nn.functional.pad(part, (0, 0, start, input.shape[0] - end))
