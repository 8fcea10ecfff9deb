"""Compiled regions: runs of a rank's statements emitted as functions that torch.compile compiles.

With the plan's `compile` knob on, code generation cuts each generated function into runs of plain
op statements (no collective, no group-aware kernel, no co-shard or recompute region, no parameter
gathered on use) that stay inside one repeated layer (plan/layers.py) or inside what comes before
or after the layer stack. Each run becomes a module-level function whose arguments and locals are
renamed canonically (`a0, a1, ...`, `t0, t1, ...`), so the runs of identical layers are the same
text and are emitted once: the 32 layers of a Llama call the same few functions, and torch.compile,
which caches per code object, compiles each of them once whatever the depth. Collectives stay
between the regions, run eagerly, as they do without compile.

Every region takes `_S` (the sizes a shape template reads, see shape_template.py) and, when its
statements make tensors on the device, `_device`, before the values it reads. The module lists
its regions in `REGIONS`; the compile stage wraps them (compiler/regions.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Graph, Ref
from nnscaler_plugins.lower.lowering import Stmt
from nnscaler_plugins.plan.layers import layer_groups

# Runs shorter than this stay inline: compiling one op buys nothing and costs a graph.
MIN_REGION_OPS = 2


def layer_labels(graph: Graph) -> dict[str, str]:
    """Op name -> the block it belongs to: "before the layers", "<stack>.<i>", "after the layers"."""
    groups = layer_groups(graph)
    out = {op.name: "before the layers" for op in groups.pre}
    for i, ops in enumerate(groups.layers):
        out.update({op.name: f"{groups.prefix}.{i}" for op in ops})
    out.update({op.name: "after the layers" for op in groups.post})
    return out


def rename_stmt(s: Stmt, names: dict[str, str]) -> Stmt:
    """The statement reading and writing the renamed variables."""
    def one(x: Any) -> Any:
        return Ref(names.get(x.name, x.name)) if isinstance(x, Ref) else x

    args = torch.utils._pytree.tree_map(one, tuple(s.args))
    kwargs = torch.utils._pytree.tree_map(one, dict(s.kwargs))
    return dataclasses.replace(s, args=args, kwargs=kwargs, out=[names.get(o, o) if o else o for o in s.out])


@dataclass
class Region:
    """One emitted region function and the places that call it."""

    name: str
    signature: list[str]
    lines: list[str]  # the body, comments included (from the first place that made it)
    returns: list[str]
    calls: list[str] = field(default_factory=list)  # the block of each call, in program order

    def text(self) -> str:
        blocks = list(dict.fromkeys(self.calls))
        where = (blocks[0] if len(blocks) == 1 else f"{len(self.calls)} calls: {blocks[0]} ... {blocks[-1]}")
        ret = ", ".join(self.returns) + ("," if len(self.returns) == 1 else "")
        return (f"\n\ndef {self.name}({', '.join(self.signature)}):\n"
                f"    # compiled region ({where}): torch.compile compiles it once for every call\n"
                + "\n".join(self.lines) + f"\n    return ({ret})\n")


class RegionBook:
    """The regions of one generated file, deduplicated by their code (comments aside)."""

    def __init__(self, graph: Graph):
        self.layer_of = layer_labels(graph)
        self.regions: list[Region] = []
        self._by_code: dict[str, Region] = {}

    def block(self, s: Stmt) -> Optional[str]:
        return self.layer_of.get(s.op.name) if s.op is not None else None

    def add(self, signature: list[str], lines: list[str], returns: list[str], block: str) -> str:
        code = "\n".join([",".join(signature)] + [ln for ln in lines if not ln.lstrip().startswith("#")]
                         + [",".join(returns)])
        region = self._by_code.get(code)
        if region is None:
            region = Region(f"_r{len(self.regions)}", signature, lines, returns)
            self._by_code[code] = region
            self.regions.append(region)
        region.calls.append(block or "the model")
        return region.name

    def text(self) -> str:
        if not self.regions:
            return ""
        names = ", ".join(f'"{r.name}"' for r in self.regions)
        return "".join(r.text() for r in self.regions) + f"\n\nREGIONS = ({names},)\n"
