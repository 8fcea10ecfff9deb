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

Under ZeRO-3 the weights of those linears are all-gathered in float8 (`fp8_all_gather`, torchao's
`enable_fsdp_float8_all_gather`): each replica casts its chunk with the weight's one tensorwise scale
(from the maximum over all chunks), so the gathered float8 values are those of casting the whole
weight, for a quarter of fp32's bytes. `all_gather_in_float8` says whether a plan does it, refusing
an explicit request where it cannot apply; `float8_weights` names the weights it applies to.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.errors import PlanError
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


def all_gather_in_float8(precision: str, zero: int, dp: int, knobs: Knobs) -> bool:
    """Whether ZeRO-3 gathers the weights of float8 linears as float8: the `fp8_all_gather` knob, on
    by default where it applies (precision "fp8" with tensorwise scaling, ZeRO-3 over more than one
    replica); an explicit True where it does not is refused by name."""
    why = None
    if precision != "fp8":
        why = f"precision={precision!r} has no float8 linears (use precision='fp8')"
    elif knobs.fp8_recipe != "tensorwise":
        why = (f"fp8_recipe={knobs.fp8_recipe!r} scales per row, and a float8 all-gather needs one scale per weight "
               "(torchao offers it for tensorwise scaling only; use fp8_recipe='tensorwise')")
    elif zero != 3 or dp <= 1:
        why = (f"weights are all-gathered only under ZeRO-3 over several data-parallel replicas (this plan: "
               f"zero={zero}, dp={dp}; use zero=3 with dp > 1)")
    if why is None:
        return knobs.fp8_all_gather is not False
    if knobs.fp8_all_gather:
        raise PlanError(f"fp8_all_gather=True cannot apply: {why}, or leave fp8_all_gather unset")
    return False


def float8_weights(graph: Graph, knobs: Knobs = Knobs(),
                   local_shape: Optional[dict[str, tuple[int, ...]]] = None) -> list[str]:
    """The parameter values read only as the weight of a float8 linear (a weight also read by
    another op, a tied embedding say, is gathered in its own dtype): those `fp8_all_gather` gathers
    in float8."""
    linears = set(float8_linears(graph, knobs, local_shape))
    as_weight: dict[str, bool] = {}
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            ok = op.name in linears and i == 1
            as_weight[v] = as_weight.get(v, True) and ok
    outputs = {v for v in graph.outputs if v}
    return [v for v, ok in as_weight.items() if ok and v not in outputs and graph.values[v].kind == "param"]
