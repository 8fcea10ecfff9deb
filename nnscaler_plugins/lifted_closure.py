"""A function with some of the tensors it closes over lifted out, to be put back later.

Why: a FlexAttention mask is a function (`mask_mod`) that closes over data -- a document id per
token, a padding mask -- and that data changes with every batch. The function's code is the same
for every batch, so the op keeps the code and the data flows in as the op's tensor inputs: capture
lifts the per-batch tensors out of the closures (`lift`), the op receives them each call and calls
the function rebuilt around them (`LiftedClosure.fill`).

The walk follows what mask functions are made of in practice: closure cells holding tensors,
nested functions (`and_masks` closes over a tuple of them), lists / tuples / dicts of those, and
`functools.partial`. Globals are not lifted: a global tensor is the same for every batch and stays
a constant of the function. Which tensors are lifted is the caller's choice (`wanted`).
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


class _Slot:
    """Where a lifted tensor goes back: the `index`-th of the tensors `fill` is given."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<lifted tensor {self.index}>"


@dataclass(frozen=True)
class _Function:
    """A plain function whose closure cells hold `cells` (templates), rebuilt by `_fill`."""

    fn: types.FunctionType
    cells: tuple


@dataclass(frozen=True)
class _Partial:
    func: Any
    args: tuple
    keywords: dict


def _template(value: Any, wanted: Callable[[torch.Tensor], bool], lifted: list[torch.Tensor],
              seen: set[int], depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        if wanted(value):
            for i, t in enumerate(lifted):  # a tensor read twice is one input
                if t is value:
                    return _Slot(i)
            lifted.append(value)
            return _Slot(len(lifted) - 1)
        return value
    if depth > 8 or id(value) in seen:
        return value
    if isinstance(value, functools.partial):
        seen.add(id(value))
        return _Partial(_template(value.func, wanted, lifted, seen, depth + 1),
                        tuple(_template(a, wanted, lifted, seen, depth + 1) for a in value.args),
                        {k: _template(v, wanted, lifted, seen, depth + 1) for k, v in value.keywords.items()})
    if isinstance(value, types.FunctionType) and value.__closure__:
        seen.add(id(value))
        cells = []
        for cell in value.__closure__:
            try:
                cells.append(_template(cell.cell_contents, wanted, lifted, seen, depth + 1))
            except ValueError:  # an empty cell (a name assigned later): nothing to lift
                cells.append(_EMPTY)
        return _Function(value, tuple(cells))
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_template(v, wanted, lifted, seen, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: _template(v, wanted, lifted, seen, depth + 1) for k, v in value.items()}
    return value


_EMPTY = object()


def _fill(template: Any, tensors: tuple) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, _Partial):
        return functools.partial(_fill(template.func, tensors), *(_fill(a, tensors) for a in template.args),
                                 **{k: _fill(v, tensors) for k, v in template.keywords.items()})
    if isinstance(template, _Function):
        fn = template.fn
        cells = tuple(types.CellType() if c is _EMPTY else types.CellType(_fill(c, tensors)) for c in template.cells)
        out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
        out.__qualname__, out.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
        out.__dict__.update(fn.__dict__)
        return out
    if isinstance(template, (list, tuple)) and not hasattr(template, "_fields"):
        return type(template)(_fill(v, tensors) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def _slots(template: Any) -> bool:
    if isinstance(template, _Slot):
        return True
    if isinstance(template, _Partial):
        return _slots(template.func) or any(_slots(a) for a in template.args) or \
            any(_slots(v) for v in template.keywords.values())
    if isinstance(template, _Function):
        return any(_slots(c) for c in template.cells)
    if isinstance(template, (list, tuple, dict)):
        return any(_slots(v) for v in (template.values() if isinstance(template, dict) else template))
    return False


@dataclass(frozen=True)
class LiftedClosure:
    """A function with `count` tensors of its closures lifted out; `fill(tensors)` is the same
    function reading `tensors` in their place."""

    template: Any
    count: int
    #: shape and dtype of each lifted tensor when lifted (for digests and messages)
    shapes: tuple

    def fill(self, tensors: tuple) -> Callable:
        if len(tensors) != self.count:
            raise ValueError(f"this function reads {self.count} lifted tensors, given {len(tensors)}")
        return _fill(self.template, tuple(tensors))

    @property
    def function(self) -> Callable:
        """The outermost user function (for names and digests of its code)."""
        t = self.template
        while isinstance(t, _Partial):
            t = t.func
        return t.fn if isinstance(t, _Function) else t


def lift(fn: Callable, wanted: Callable[[torch.Tensor], bool]) -> tuple[Optional[LiftedClosure], list[torch.Tensor]]:
    """The tensors `fn` closes over for which `wanted` holds, in a stable order, and the function
    that takes them back (None, [] when there are none)."""
    lifted: list[torch.Tensor] = []
    template = _template(fn, wanted, lifted, set(), 0)
    if not lifted or not _slots(template):
        return None, []
    return LiftedClosure(template, len(lifted), tuple((tuple(t.shape), t.dtype) for t in lifted)), lifted


def code_of(template: Any) -> list[Any]:
    """What a lifted function computes apart from its lifted tensors, for a digest: every code
    object, the globals it names and every kept value, slots by position."""
    out: list[Any] = []

    def walk(t: Any) -> None:
        if isinstance(t, _Slot):
            out.append(("slot", t.index))
        elif isinstance(t, _Partial):
            walk(t.func)
            for a in t.args:
                walk(a)
            for k in sorted(t.keywords):
                out.append(k)
                walk(t.keywords[k])
        elif isinstance(t, _Function):
            codes = [t.fn.__code__]
            while codes:  # its code and the globals it names (constants of every batch), not its cells
                c = codes.pop()
                out.append(c)
                out.extend(t.fn.__globals__[n] for n in c.co_names
                           if n in t.fn.__globals__ and not inspect.ismodule(t.fn.__globals__[n]))
                codes += [k for k in c.co_consts if inspect.iscode(k)]
            for c in t.cells:
                walk(c)
        elif isinstance(t, (list, tuple)) and not hasattr(t, "_fields"):
            for v in t:
                walk(v)
        elif isinstance(t, dict):
            for k in t:
                out.append(k)
                walk(t[k])
        else:
            out.append(t)

    walk(template)
    return out
