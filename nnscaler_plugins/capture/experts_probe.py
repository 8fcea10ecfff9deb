"""What an experts module computes, learned by running it on small made-up inputs.

Mixture-of-experts layers are written in many ways (a loop over the experts that were hit, one
grouped matmul behind cumulative offsets, a `ModuleList` of expert MLPs, stacked weights stored
either way round), and the split sizes they read from their counts are data, which capture cannot
trace. So whether a module is an experts module, and which splits of it are exact, is not read
from its name or its code: the module's own forward is run on made-up rows and weights of its
layout, and what it returns is compared.

The layout (`experts_layout`): either every parameter is stacked along one leading dim of `E`
experts (two or more of them expert matrices `(E, in, out)`: a gate and a down projection at
least), or the module holds a `ModuleList` of `E` identical expert modules and no parameter of its
own.

The sorted calling convention (`sorted_convention`): `module(rows (N, H) sorted by expert, counts
(E,) [, probability per row])` returning the N output rows, or a tuple holding them (Megatron's
`(output, bias)` with the bias None). Tried with integer counts, then floating ones (`histc`).

Two properties the plans rely on (`rows_split_exactly`, `experts_split_exactly`): a piece of the
rows run with its own counts gives the same rows, and a share of the experts run on their rows
with their weights gives the same rows. Made-up weights are the module's real shapes when small,
else shrunk (the hidden size to 16, the other dims in proportion to the smallest); a module whose
code insists on its real sizes is then simply not probed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.func import functional_call

from nnscaler_plugins.kernels.experts_module import SortedConvention, run_sorted_experts

_SMALL = 1 << 20  # parameters up to this many elements are probed at their real shapes
_PROBE_HIDDEN, _PROBE_WIDTH = 16, 8


@dataclass(frozen=True)
class ExpertsLayout:
    """How a module holds its experts: `kind` "stacked" (every parameter (E, ...)) or "list" (a
    ModuleList of E experts); its parameter names and shapes in `named_parameters` order."""

    kind: str
    experts: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def per_expert_shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's shape without the experts (stacked: the leading dim dropped)."""
        return [s[1:] for s in self.shapes] if self.kind == "stacked" else list(self.shapes)


def experts_layout(module: torch.nn.Module) -> Optional[ExpertsLayout]:
    """The module's experts layout, or None when it has neither (or has buffers: they would not
    travel with the weights a piece is given)."""
    if any(True for _ in module.buffers()):
        return None
    named = list(module.named_parameters())
    if len(named) < 2:
        return None
    shapes = tuple(tuple(p.shape) for _, p in named)
    names = tuple(n for n, _ in named)
    # stacked expert matrices are (E, in, out): a module of plain 2-D weights whose first dims happen to
    # agree (an attention block's square projections) is not one, and is not run to find out
    matrices = sum(len(s) >= 3 for s in shapes)
    if all(len(s) >= 2 for s in shapes) and len({s[0] for s in shapes}) == 1 and shapes[0][0] >= 1 and matrices >= 2:
        return ExpertsLayout("stacked", shapes[0][0], names, shapes)
    children = list(module.named_children())
    if len(children) != 1 or not isinstance(children[0][1], torch.nn.ModuleList):
        return None
    experts = list(children[0][1])
    if len(experts) < 2 or len({type(e) for e in experts}) != 1:
        return None
    signature = [tuple((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in experts]
    if not signature[0] or any(s != signature[0] for s in signature):
        return None
    return ExpertsLayout("list", len(experts), names, shapes)


def _shrink(layout: ExpertsLayout, hidden: int) -> Optional[dict[int, int]]:
    """Probe size of each real dim: the identity when the module is small, else hidden -> 16 and
    every other dim in proportion to the smallest (None when they are not multiples of it)."""
    dims = {d for s in layout.per_expert_shapes() for d in s}
    if sum(math.prod(s) for s in layout.shapes) <= _SMALL:
        return {d: d for d in dims | {hidden}}
    others = sorted(d for d in dims if d != hidden)
    if others and any(d % others[0] for d in others):
        return None
    out = {hidden: _PROBE_HIDDEN}
    out.update({d: d // others[0] * _PROBE_WIDTH for d in others})
    return out


def probe_weights(layout: ExpertsLayout, hidden: int, experts: Optional[int] = None,
                  seed: int = 0) -> Optional[tuple[list[torch.Tensor], int]]:
    """Made-up weights in the module's layout (`experts` of them, default all) and the probe's hidden
    size; None when the dims cannot be shrunk in proportion."""
    sizes = _shrink(layout, hidden)
    if sizes is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    e = layout.experts if experts is None else experts
    out = []
    for shape in layout.shapes:
        if layout.kind == "stacked":
            probe = (e,) + tuple(sizes[d] for d in shape[1:])
        else:
            probe = tuple(sizes[d] for d in shape)
        fan_in = probe[-1] if len(probe) > 1 else 1
        out.append(torch.randn(probe, generator=gen) / math.sqrt(fan_in))
    return out, sizes[hidden]


def probe_counts(experts: int) -> torch.Tensor:
    """Rows per expert for a probe: 1, 2, 0, 1, 2, 0, ... (an expert with no rows, one with several)."""
    counts = torch.tensor([(1, 2, 0)[e % 3] for e in range(experts)], dtype=torch.int64)
    if int(counts.sum()) < 2:
        counts[0] = 2
    return counts


def _rows_of(out: object, rows: int, hidden: int) -> Optional[tuple[Optional[int], int]]:
    """Where the (rows, hidden) output sits in what the module returned: (None, 1) for the tensor
    itself, (i, n) for element i of an n-tuple whose other elements are None."""
    if isinstance(out, torch.Tensor):
        return (None, 1) if tuple(out.shape) == (rows, hidden) and out.is_floating_point() else None
    if isinstance(out, (tuple, list)) and out:
        found = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor)]
        if len(found) == 1 and all(o is None for i, o in enumerate(out) if i != found[0]):
            o = out[found[0]]
            if tuple(o.shape) == (rows, hidden) and o.is_floating_point():
                return found[0], len(out)
    return None


def sorted_conventions(module: torch.nn.Module, layout: ExpertsLayout) -> dict[int, SortedConvention]:
    """For each hidden size the module may be called with, how it takes sorted rows (found by
    calling it): empty when it does not compute one row per sorted row that way. Call this before
    the module's forward is replaced."""
    found: dict[int, SortedConvention] = {}
    for hidden in sorted({d for s in layout.per_expert_shapes() for d in s}):
        made = probe_weights(layout, hidden)
        if made is None:
            continue
        weights, h = made
        counts = probe_counts(layout.experts)
        rows = int(counts.sum())
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, h, generator=gen)
        probs = torch.rand(rows, generator=gen)
        params = dict(zip(layout.names, weights))
        for dtype in (torch.int64, torch.float32):
            for with_probs in (False, True):
                args = (x, counts.to(dtype)) + ((probs,) if with_probs else ())
                try:
                    with torch.no_grad():
                        out = functional_call(module, params, args, strict=True)
                except Exception:  # noqa: BLE001 - a call the module does not take is simply not its convention
                    continue
                where = _rows_of(out, rows, h)
                if where is not None:
                    found[hidden] = SortedConvention(layout.experts, with_probs, dtype, *where)
                    break
            if hidden in found:
                break
    return found


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _runs(key: str, names: Sequence[str], layout: ExpertsLayout, hidden: int, probs: bool):
    made = probe_weights(layout, hidden)
    if made is None:
        return None
    weights, h = made
    counts = probe_counts(layout.experts)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), h, generator=gen)
    p = torch.rand(x.shape[0], generator=gen) if probs else None
    return weights, counts, x, p


def rows_split_exactly(key: str, names: Sequence[str], layout: ExpertsLayout, hidden: int, probs: bool) -> bool:
    """Whether the module's rows computed in two pieces (cut inside one expert's rows), each with
    its own counts, equal the rows computed whole."""
    made = _runs(key, names, layout, hidden, probs)
    if made is None:
        return False
    weights, counts, x, p = made
    try:
        with torch.no_grad():
            whole = run_sorted_experts(key, tuple(names), x, counts, p, tuple(weights))
            e = int(torch.nonzero(counts >= 2)[0])
            cut = int(counts[:e].sum()) + 1
            first, second = counts.clone(), counts.clone()
            first[e + 1:] = 0
            first[e] = 1
            second[:e] = 0
            second[e] -= 1
            parts = [run_sorted_experts(key, tuple(names), x[a:b], c, None if p is None else p[a:b], tuple(weights))
                     for a, b, c in ((0, cut, first), (cut, x.shape[0], second))]
    except Exception:  # noqa: BLE001 - a module that cannot run on a piece of its rows does not split by rows
        return False
    return _close(torch.cat(parts), whole)


def experts_split_exactly(key: str, names: Sequence[str], layout: ExpertsLayout, hidden: int, probs: bool) -> bool:
    """Whether each half of the experts, run on its own rows with its own weights, gives the rows
    the whole module gives (stacked weights only: a share of a ModuleList is not a weight slice)."""
    if layout.kind != "stacked" or layout.experts < 2:
        return False
    made = _runs(key, names, layout, hidden, probs)
    if made is None:
        return False
    weights, counts, x, p = made
    half = layout.experts // 2
    bound = int(counts[:half].sum())
    try:
        with torch.no_grad():
            whole = run_sorted_experts(key, tuple(names), x, counts, p, tuple(weights))
            parts = [run_sorted_experts(key, tuple(names), x[a:b], counts[e0:e1],
                                        None if p is None else p[a:b], tuple(w[e0:e1] for w in weights))
                     for a, b, e0, e1 in ((0, bound, 0, half), (bound, x.shape[0], half, layout.experts))]
    except Exception:  # noqa: BLE001 - a module that cannot run on a share of its experts does not split by experts
        return False
    return _close(torch.cat(parts), whole)
