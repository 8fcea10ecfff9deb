"""Batches of any size: which input dims vary, the program that serves them, and what a size must divide.

This is the compile stage's callback to the runtime: a ParallelModule hands it each call's inputs and
runs the `ShapeProgram` it gets back; making a new program (capture at other sizes, lowering,
generating code) happens here, never in the runtime.

The plan and the program are made for the example's shapes. When a call brings other sizes, the
input dims that have differed from the example in any call so far become symbols (dims that have
always agreed in size share one: batch, sequence). For each set of symbols the program is
generated once more at a few sizes of a weightless copy of the model and fitted into one file whose
sizes are read at run time (codegen/shape_template.py); every later size costs nothing but filling
`_S`. A size that a split dim cannot take (a sequence split in two of odd length) is refused before
the call, naming the input, the dim, its size and the divisor.

When a model's program changes with the sizes in more than its sizes (its code branches on a
length), no such file exists: each new shape then gets a program of its own, captured and
compiled when it first comes (warned once, with the cost of one).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from nnscaler_plugins.capture.tracing import CaptureError, capture
from nnscaler_plugins.codegen.generate import generate, load_source, variant
from nnscaler_plugins.codegen.shape_template import fit_ints, fit_sources, same_code
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.lowering import Program, lower
from nnscaler_plugins.progress import phase

Shapes = tuple[Optional[tuple[int, ...]], ...]
Position = tuple[int, int]  # (graph input index, dim)


@dataclasses.dataclass(frozen=True)
class ShapeProgram:
    """What runs a call of given sizes: the generated module (its `_S` sizes filled in) and the Program
    whose communication tables its collectives index (the example's, or, for a program generated at
    other sizes that communicates differently, its own over the same process groups)."""

    module: Any
    program: Program


class _Fitted:
    """One program for a set of symbols: its module, its polynomials and boundary shapes."""

    def __init__(self, module: Any, template: Any, symbols: list[list[Position]], boundary: dict[str, list[Any]],
                 points: Sequence[Sequence[int]]):
        self.module = module
        self.template = template
        self.symbols = symbols
        self.boundary = boundary  # boundary value -> per dim a Poly
        # Per symbol, the sizes the fit was checked between. A size outside is checked once more
        # before it runs: a literal that is min(S, window) in the model is S inside the range the fit
        # saw and the window beyond it, and only a program generated out there tells them apart.
        self.lo = [min(p[i] for p in points) for i in range(len(symbols))]
        self.hi = [max(p[i] for p in points) for i in range(len(symbols))]
        self.checked: set[tuple[int, ...]] = set()  # sizes outside the range found to fit

    def covers(self, values: Sequence[int]) -> bool:
        return all(lo <= v <= hi for v, lo, hi in zip(values, self.lo, self.hi)) or tuple(values) in self.checked

    def widen(self, values: Sequence[int]) -> None:
        """The fit held at `values`: every size between the old range and them is covered too."""
        self.checked.add(tuple(values))
        self.lo = [min(v, lo) for v, lo in zip(values, self.lo)]
        self.hi = [max(v, hi) for v, hi in zip(values, self.hi)]


class ShapePrograms:
    """Per rank: picks (and when needed makes) the program for a call's sizes."""

    def __init__(self, program: Program, unit_device: int, live_module: Any, live_source: str, skeleton: Any,
                 cache_dir: str, why_no_skeleton: str = "", regions: Optional[bool] = None,
                 compile_module: Optional[Callable[[Any, bool], None]] = None):
        # Files for other sizes are generated as the live one was (with compiled regions or not), and
        # each loaded one is handed to `compile_module(module, dynamic)`: dynamic for the file
        # fitted for every size, static for a file of one shape.
        self.regions = regions
        self.compile_module = compile_module
        self.program = program
        self.graph = program.graph
        self.unit_device = unit_device
        self.live = live_module
        self.live_source = live_source
        self.skeleton = skeleton
        self.why_no_skeleton = why_no_skeleton
        self.cache_dir = cache_dir
        self.example: Shapes = tuple(None if self.graph.values[s.name].meta is None
                                     else tuple(self.graph.values[s.name].meta.shape) for s in self.graph.inputs)
        self.seen: list[Shapes] = [self.example]  # the example and each shape that added a symbol
        self.symbols: Optional[list[list[Position]]] = None
        self.fitted: dict[tuple, Optional[_Fitted]] = {}
        self.per_shape: dict[Shapes, ShapeProgram] = {}
        self.refused: dict[Shapes, str] = {}  # sizes no program could be made for, and why
        self.per_shape_boundary: dict[Shapes, dict[str, tuple[int, ...]]] = {}
        self.fit_failure = ""
        self.rebuild_seconds: list[float] = []

    # -- what the runtime calls -------------------------------------------------------------------------
    def shapes_of(self, flat: Sequence[Any]) -> Shapes:
        return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)

    def program_for(self, flat: Sequence[Any], args: tuple, kwargs: dict, alone: bool = True) -> ShapeProgram:
        """The program to run these inputs with (its module's `_S` filled in); raises PlanError for
        sizes the plan cannot take. `args`/`kwargs` (the call's own structure) are what a new capture
        takes. With `alone=False`, sizes no shape template serves are refused rather than given a
        program of their own (a capture per new shape): the caller runs the model's own forward then."""
        shapes = self.shapes_of(flat)
        if shapes == self.example and self.symbols is None:
            return ShapeProgram(self.live, self.program)
        if not self._fits_symbols(shapes):
            self._check_ranks(shapes)
            if len(self.seen) == 1:
                # The first other size: the batch and length dims are taken as varying too (a
                # loader's last batch is smaller), so one fit serves them all.
                self.seen.append(self._batch_varied())
            self.seen.append(shapes)
            self.symbols = self._symbols()
        key = tuple(tuple(g) for g in self.symbols)
        if key not in self.fitted and not self.fit_failure:
            with phase(f"{self.graph.model_class}: one program for every size of "
                       f"{', '.join(self.describe(g[0]) for g in self.symbols)} (once)"):
                self.fitted[key] = self._fit(self.symbols, args, kwargs)
        fitted = self.fitted.get(key)
        if fitted is None:
            return ShapeProgram(self.live, self.program) if shapes == self.example else \
                self._per_shape(shapes, args, kwargs, alone)
        values = [shapes[g[0][0]][g[0][1]] for g in self.symbols]
        if shapes != self.example:
            self._check_divisible(fitted, values)
            if shapes in self.per_shape:
                return self.per_shape[shapes]
            if not fitted.covers(values) and not self._holds_at(fitted, values, args, kwargs):
                return self._per_shape(shapes, args, kwargs, alone)
        fitted.module._S[:] = values
        return ShapeProgram(fitted.module, self.program)

    def _fits_symbols(self, shapes: Shapes) -> bool:
        """Whether `shapes` differ from the example only in the symbols' dims, each symbol's dims
        agreeing in size (no new symbol to fit)."""
        if self.symbols is None:
            return shapes == self.example
        free = set()
        for g in self.symbols:
            if len({shapes[i][d] if shapes[i] is not None and d < len(shapes[i]) else None for i, d in g}) != 1:
                return False
            free.update(g)
        for i, (ex, got) in enumerate(zip(self.example, shapes)):
            if ex is None or got is None or len(ex) != len(got):
                if ex != got:
                    return False
                continue
            if any(a != b and (i, d) not in free for d, (a, b) in enumerate(zip(ex, got))):
                return False
        return True

    def check(self, flat: Sequence[Any], args: tuple, kwargs: dict, alone: bool = True) -> Optional[str]:
        """Why these inputs cannot run (None when they can), without running them (`alone` as in
        `program_for`)."""
        try:
            self.program_for(flat, args, kwargs, alone)
        except PlanError as e:
            return str(e)
        return None

    def boundary_shape(self, value: str, flat: Sequence[Any]) -> tuple[int, ...]:
        """The whole shape of pipeline boundary `value` for a micro-batch with these inputs."""
        shapes = self.shapes_of(flat)
        if shapes == self.example:
            return tuple(self.graph.meta(value).shape)
        if shapes in self.per_shape_boundary:
            return self.per_shape_boundary[shapes][value]
        fitted = self._current()
        assert fitted is not None, "program_for runs before a boundary is received"
        values = [shapes[g[0][0]][g[0][1]] for g in fitted.symbols]
        return tuple(int(p(values)) for p in fitted.boundary[value])

    # -- symbols ----------------------------------------------------------------------------------------
    def _current(self) -> Optional[_Fitted]:
        return None if self.symbols is None else self.fitted.get(tuple(tuple(g) for g in self.symbols))

    def _check_ranks(self, shapes: Shapes) -> None:
        for spec, ex, got in zip(self.graph.inputs, self.example, shapes):
            if (ex is None) != (got is None) or (ex is not None and len(ex) != len(got)):
                raise PlanError(f"input {_name(spec)} has shape {got} but the model was captured with {ex}: "
                                "sizes may change, the number of dims may not")

    def _batch_varied(self) -> Shapes:
        """The example with the dims that vary in practice changed: the leading dim of every input
        of the batch's size, and the length (dim 1) of token-like inputs (integer or bool, 2+ dims)
        of the first one's length. Scaled by 2 and 3, so the two stay apart when equal. A batch of 1
        stays 1 (packed rows: one row of any length; size 1 cannot be fitted, see `_fit`)."""
        first = next((s for s in self.example if s), None)
        if not first:
            return self.example
        b = first[0]
        metas = [self.graph.values[s.name].meta for s in self.graph.inputs]
        tokens = [i for i, m in enumerate(metas) if m is not None and m.ndim >= 2
                  and not m.dtype.is_floating_point and not m.dtype.is_complex]
        length = self.example[tokens[0]][1] if tokens else None
        out = []
        for i, s in enumerate(self.example):
            if s is None:
                out.append(None)
                continue
            s = list(s)
            if s and s[0] == b and b != 1:
                s[0] = 2 * b
            if i in tokens and s[1] == length:
                s[1] = 3 * length
            out.append(tuple(s))
        return tuple(out)

    def _symbols(self) -> list[list[Position]]:
        """Dims that have varied, grouped by always having had the same size."""
        groups: dict[tuple[int, ...], list[Position]] = {}
        for i, ex in enumerate(self.example):
            for d in range(len(ex or ())):
                sizes = tuple(s[i][d] for s in self.seen)
                if len(set(sizes)) > 1:
                    groups.setdefault(sizes, []).append((i, d))
        return sorted(groups.values())

    def describe(self, pos: Position) -> str:
        return f"{_name(self.graph.inputs[pos[0]])}.shape[{pos[1]}]"

    def _check_divisible(self, fitted: _Fitted, values: list[int]) -> None:
        names = [self.describe(g[0]) for g in fitted.symbols]
        for poly in fitted.template.polys:
            v = poly(values)
            if v.denominator == 1 and v >= 0:
                continue
            sizes = ", ".join(f"{n} = {x}" for n, x in zip(names, values))
            monos = [m for m, c in poly.terms if c and m]
            if len(monos) == 1 and len(monos[0]) == 1:
                i = monos[0][0]
                need = poly.divisor
                raise PlanError(f"{names[i]} is {values[i]}, but the plan splits that dim and needs it divisible "
                                f"by {need} (next sizes that fit: {_round_up(values[i], need)}); pad the batch "
                                f"to a multiple of {need} or choose a plan that does not split it")
            raise PlanError(f"the plan cannot take sizes {sizes}: its size {poly.describe(names)} comes to {v}, "
                            f"not a whole number; pad to multiples of {poly.divisor}")

    # -- making programs --------------------------------------------------------------------------------
    def _fit(self, symbols: list[list[Position]], args: tuple, kwargs: dict) -> Optional[_Fitted]:
        start = time.perf_counter()
        if self.skeleton is None:
            self.fit_failure = self.why_no_skeleton or "the model could not be copied for another capture"
            return None
        if len(symbols) > 4:
            self.fit_failure = f"{len(symbols)} input dims vary independently (at most 4 are fitted)"
            return None
        base = [self.example[g[0][0]][g[0][1]] for g in symbols]
        if 1 in base:
            names = [self.describe(g[0]) for b, g in zip(base, symbols) if b == 1]
            self.fit_failure = (f"the example has size 1 in {', '.join(names)}, and programs traced at size 1 differ "
                                "from larger ones (broadcasting); give example inputs with at least 2 there "
                                "(2 samples per micro-batch)")
            return None
        points = [tuple(b * f for b, f in zip(base, fs)) for fs in itertools.product((1, 2), repeat=len(symbols))]
        points.sort(key=lambda p: sum(x != b for x, b in zip(p, base)))  # the example first
        # At the example's sizes the program is the one running: no capture needed.
        made = [(self.live_source, {b.value: tuple(self.graph.meta(b.value).shape) for b in self.program.boundaries})]
        made += [self._generate(symbols, p, args, kwargs) for p in points[1:]]
        if any(isinstance(m, str) for m in made):
            self.fit_failure = next(m for m in made if isinstance(m, str))
            return None
        template, why = fit_sources(points, [m[0] for m in made])
        if template is None:
            self.fit_failure = why
            return None
        boundary: dict[str, list[Any]] = {}
        for b in self.program.boundaries:
            dims = []
            for d in range(len(made[0][1][b.value])):
                poly = fit_ints(points, [m[1][b.value][d] for m in made])
                dims.append(poly)
            boundary[b.value] = dims
        step = math.lcm(*(p.divisor for p in template.polys)) if template.polys else 1
        check = tuple(b + step if b + step != 2 * b else b + 2 * step for b in base)
        extra = self._generate(symbols, check, args, kwargs)
        if isinstance(extra, str) or not same_code(template.at(check), extra[0]) or any(
                tuple(int(p(check)) for p in boundary[v]) != extra[1][v] for v in boundary):
            self.fit_failure = (f"the program at sizes {list(check)} is not the one the sizes {points} predict"
                                if not isinstance(extra, str) else extra)
            return None
        module = self._load(template.render([self.describe(g[0]) for g in symbols]), "shapes_" + "_".join(
            "-".join(f"{i}.{d}" for i, d in g) for g in symbols))
        if self.compile_module is not None:
            self.compile_module(module, True)  # one graph per region for every size
        fitted = _Fitted(module, template, symbols, boundary, list(points) + [check])
        self._reach(fitted, args, kwargs)
        self.rebuild_seconds.append(time.perf_counter() - start)
        return fitted

    def _fits(self, fitted: _Fitted, probe: list[int], args: tuple, kwargs: dict) -> bool:
        """Whether the program generated at sizes `probe` is the fitted one (a capture at those sizes)."""
        made = self._generate(fitted.symbols, probe, args, kwargs)
        return not isinstance(made, str) and same_code(fitted.template.at(probe), made[0]) and all(
            tuple(int(p(probe)) for p in fitted.boundary[v]) == made[1][v] for v in fitted.boundary)

    def _reach(self, fitted: _Fitted, args: tuple, kwargs: dict) -> None:
        """Check the fitted program a factor of 4 below and above the sizes it was fitted at, in the
        same one-time phase: a stream of sizes (lengths from a padding collator) then seldom stops
        later for a check of a new smallest or largest size (`_holds_at`), each a capture. A probe
        the program does not hold at (a size past the model's positions, a clamp) widens nothing."""
        step = math.lcm(*(p.divisor for p in fitted.template.polys)) if fitted.template.polys else 1
        low = [max(2 * step, (lo // 4) // step * step) for lo in fitted.lo]
        high = [-(-hi * 4 // step) * step for hi in fitted.hi]
        for probe in (low, high):
            if all(lo <= v <= hi for v, lo, hi in zip(probe, fitted.lo, fitted.hi)):
                continue
            if self._fits(fitted, probe, args, kwargs):
                fitted.widen(probe)

    def _holds_at(self, fitted: _Fitted, values: list[int], args: tuple, kwargs: dict) -> bool:
        """Whether the fitted program is the one generated at sizes outside the range it was
        checked on (widening the range when it is); once per new smallest or largest size."""
        def fits(probe: list[int]) -> bool:
            return self._fits(fitted, probe, args, kwargs)

        # First a leap: twice past the old range (or half below it), so a stream of lengths stops
        # paying for checks after its first few records; a clamp inside the leap fails it, and the
        # sizes themselves are checked instead. Size 1 traces into another program (broadcasting
        # specializes it), which the general one still computes right: it is checked at 2.
        step = math.lcm(*(p.divisor for p in fitted.template.polys)) if fitted.template.polys else 1
        leap = []
        for v, lo, hi in zip(values, fitted.lo, fitted.hi):
            if v > hi:
                v = -(-max(v, 2 * hi) // step) * step
            elif v < lo:
                v = max(step, min(v, lo // 2) // step * step)
            leap.append(v)
        exact = [2 if v == 1 else v for v in values]
        holds = False
        for probe in ([leap, exact] if leap != exact else [exact]):
            if fits(probe):
                fitted.widen(probe)
                fitted.checked.add(tuple(values))
                holds = True
                break
        if not holds and not self.fit_failure:
            self.fit_failure = (f"at sizes {values} the model's program is not the fitted one (a size the model "
                                "clamps, or code that branches on a length)")
        return holds

    def _inputs_at(self, symbols: list[list[Position]], sizes: Sequence[int], args: tuple, kwargs: dict,
                   exact: Optional[Shapes] = None) -> tuple[tuple, dict]:
        """The call's structure with each graph input replaced by a tensor of the wanted shape
        (values do not matter: capture traces with fake tensors)."""
        want = [list(ex) if ex is not None else None for ex in (exact or self.example)]
        if exact is None:
            for g, size in zip(symbols, sizes):
                for i, d in g:
                    want[i][d] = size
        args, kwargs = list(args), dict(kwargs)
        for spec, shape in zip(self.graph.inputs, want):
            if shape is None:
                continue
            where, key, *rest = spec.path
            holder = args if where == "args" else kwargs
            if rest:
                continue  # nested inputs keep the call's tensors: only top-level ones are resized
            x = holder[key]
            # On the skeleton's device: an input that meets a weight or buffer directly (position ids
            # times a rotary buffer) must not mix devices; the program made is the same as on the CPU.
            holder[key] = torch.zeros(shape, dtype=x.dtype, device="meta")
        return tuple(args), kwargs

    def _generate(self, symbols: list[list[Position]], sizes: Sequence[int], args: tuple, kwargs: dict,
                  exact: Optional[Shapes] = None) -> Any:
        """(source, boundary shapes) of this rank at these sizes, or why it could not be made."""
        a, k = self._inputs_at(symbols, sizes, args, kwargs, exact)
        try:
            g = capture(self.skeleton, a, k)
        except CaptureError as e:
            return f"capturing at sizes {list(sizes)} failed: {str(e).splitlines()[0]}"
        mine = [op.name for op in self.graph.ops]
        if [op.name for op in g.ops] != mine:
            first = next((o for i, o in enumerate(g.ops) if i >= len(mine) or o.name != mine[i]), g.ops[-1])
            return (f"the model's code takes other ops at sizes {list(sizes)} than at the example's "
                    f"({len(g.ops)} ops, not {len(mine)}; first: {first.where()})")
        plan = dataclasses.replace(self.program.plan, graph_fingerprint=g.fingerprint())
        try:
            prog = lower(g, plan)
        except PlanError as e:
            return f"the plan does not fit sizes {list(sizes)}: {e}"
        if prog.tables_key() != self.program.tables_key() and (exact is None or not self._own_tables_allowed(prog)):
            return (f"the plan communicates otherwise at sizes {list(sizes) or [list(s) for s in exact if s]} than "
                    f"at the example's (a split through a dim merged with a size that varies, so its block count "
                    f"follows the size)")
        return (generate(prog, self.unit_device, self.regions), {b.value: tuple(g.meta(b.value).shape) for b in prog.boundaries},
                prog)

    def _which_sizes(self, shapes: Shapes, why: str) -> str:
        """The input dims that differ from the example's, and what a dim the plan splits must be
        divisible by when the lowering says so, put before the lowering's own words."""
        changed = [f"{self.describe((i, d))} is {got[d]} (the example's {ex[d]})"
                   for i, (ex, got) in enumerate(zip(self.example, shapes)) if ex is not None and got is not None
                   for d in range(min(len(ex), len(got))) if ex[d] != got[d]]
        if not changed:
            return ""
        m = re.search(r"not divisible by splits (\d+) x blocks (-?\d+)", why)
        need = f"; the plan splits a dim these sizes reach and needs it divisible by " \
               f"{int(m.group(1)) * abs(int(m.group(2)))}" if m else ""
        return f"{', '.join(changed)}{need}: "

    def _own_tables_allowed(self, prog: Any) -> bool:
        """Whether a program whose tables differ from the example's can run with tables of its own:
        the same parameters in the same places and no process group the set-up did not make."""
        mine, theirs = self.program.tables_key(), prog.tables_key()
        return mine[4] == theirs[4] and set(prog.groups_needed()) <= set(self.program.groups_needed())

    def _load(self, source: str, tag: str) -> Any:
        return load_source(self.program, self.unit_device, self.cache_dir, source,
                           tag + variant(self.program, self.regions))

    def _per_shape(self, shapes: Shapes, args: tuple, kwargs: dict, alone: bool = True) -> ShapeProgram:
        if shapes in self.per_shape:
            return self.per_shape[shapes]
        if shapes in self.refused:  # told once why: a refused size is not captured again at every batch
            raise PlanError(self.refused[shapes])
        if not alone:
            raise PlanError(f"inputs of shapes {[s for s in shapes if s is not None]} need a program of their own "
                            f"({self.fit_failure or 'no shape template serves them'})")
        start = time.perf_counter()
        made = self._generate([], (), args, kwargs, exact=shapes)
        if isinstance(made, str):
            self.refused[shapes] = (f"inputs of shapes {[s for s in shapes if s is not None]} cannot run under this "
                                    f"plan: {self._which_sizes(shapes, made)}{made}")
            raise PlanError(self.refused[shapes])
        module = self._load(made[0], "shape_" + "_".join("x".join(map(str, s)) for s in shapes if s is not None))
        if self.compile_module is not None:
            self.compile_module(module, False)
        # its collectives index its own tables where they differ from the example's
        own = made[2] if made[2].tables_key() != self.program.tables_key() else self.program
        self.per_shape[shapes] = ShapeProgram(module, own)
        self.per_shape_boundary[shapes] = made[1]
        took = time.perf_counter() - start
        self.rebuild_seconds.append(took)
        if len(self.per_shape) == 1:
            warnings.warn(f"{self.graph.model_class}: one program cannot serve every input size here "
                          f"({self.fit_failure}); each new shape gets its own program when it first comes "
                          f"(this one took {took:.2f} s). Padding batches to a few fixed lengths avoids it.",
                          stacklevel=3)
        return self.per_shape[shapes]


def _name(spec: Any) -> str:
    return "input " + repr(spec.path[1]) + "".join(f"[{k!r}]" for k in spec.path[2:])


def _round_up(n: int, k: int) -> int:
    return ((n + k - 1) // k) * k
