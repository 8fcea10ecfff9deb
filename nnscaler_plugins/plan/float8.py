"""Which linears of a `precision="fp8"` plan run float8 matmuls (kernels/float8.py): read by code
generation, which calls the float8 kernel for them, and by the search, which prices them at the
device's float8 peak.

torchao's `convert_to_float8_training` converts every `nn.Linear` its `module_filter_fn` lets
through (all of them by default); float8 matmuls need both weight dims divisible by 16, which
torchao's own filters require too. Here the same choice is made on the captured graph: an
`aten.linear` op whose module is a `Linear` and whose weight is that module's own `weight`, with
the piece of the weight this device multiplies divisible by 16 in both dims. The plan's knobs
override it: `fp8_linears` (module paths, fnmatch patterns) converts only the modules they match,
`fp8_skip` keeps modules whose path contains one of its strings in bf16 (torchao's `filter_fqns`,
torchtitan's `["output"]`).
"""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.plan.knobs import Knobs

FLOAT8_MULTIPLE = 16  # float8 matmuls take dims that are multiples of 16


def is_module_linear(graph: Graph, op: OpNode) -> bool:
    """An `aten.linear` op made by an `nn.Linear` (or a subclass) from its own weight."""
    if op.target is not torch.ops.aten.linear.default or not op.module_type.endswith("Linear"):
        return False
    w = graph.values.get(op.inputs[1]) if len(op.inputs) > 1 else None
    return w is not None and w.kind == "param" and w.fqn == f"{op.module_path}.weight"


def chosen(knobs: Knobs, module_path: str) -> bool:
    """Whether the knobs let the module at `module_path` run in float8."""
    if any(s in module_path for s in knobs.fp8_skip):
        return False
    return not knobs.fp8_linears or any(fnmatch.fnmatchcase(module_path, p) for p in knobs.fp8_linears)


def float8_linears(graph: Graph, knobs: Knobs = Knobs(),
                   local_shape: Optional[dict[str, tuple[int, ...]]] = None) -> list[str]:
    """Names of the linear ops a `precision="fp8"` plan with these knobs runs in float8.
    `local_shape`: weight value -> the shape of the piece one device multiplies (default: whole)."""
    out = []
    for op in graph.ops:
        if not is_module_linear(graph, op) or not chosen(knobs, op.module_path):
            continue
        shape = (local_shape or {}).get(op.inputs[1]) or tuple(graph.meta(op.inputs[1]).shape)
        if len(shape) == 2 and all(d % FLOAT8_MULTIPLE == 0 for d in shape):
            out.append(op.name)
    return out
