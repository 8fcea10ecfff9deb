"""One generated program for every batch size and sequence length.

A program is generated for fixed shapes: its integer literals (view sizes, arange ends, expand
sizes, the local size of a split dim) are numbers. Generated for a few sizes of the varying input
dims (the symbols: batch, sequence), the files are the same token for token except for those
literals, and each literal is a multilinear polynomial in the symbols with rational coefficients:
the local size of a sequence split in two is S/2, a flattened batch is B*S. Fitting each literal on
a grid of 2^k points (k symbols) and checking the fit on one more point gives a file whose literals
are expressions of `_S`, the symbol values the runtime sets before each call. The plan, the
lowering and every split stay those of the fixed-shape program; only sizes are read at run time.

Where the files differ in anything but integer literals (a model whose code branches on a length),
no template exists and `fit_sources` says why.
"""
from __future__ import annotations

import io
import itertools
import math
import re
import tokenize
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence


@dataclass(frozen=True)
class Poly:
    """sum(coef * prod(symbols in mono)); monomials are tuples of symbol indices (multilinear)."""

    terms: tuple[tuple[tuple[int, ...], Fraction], ...]

    def __call__(self, values: Sequence[int]) -> Fraction:
        return sum((c * math.prod(values[i] for i in mono) for mono, c in self.terms), Fraction(0))

    @property
    def constant(self) -> bool:
        return all(not mono for mono, c in self.terms if c)

    @property
    def divisor(self) -> int:
        """What the numerator must be divisible by for the value to be an integer."""
        return math.lcm(*(c.denominator for _, c in self.terms)) if self.terms else 1

    def code(self, var: str = "_S") -> str:
        den = self.divisor
        parts = []
        for mono, c in self.terms:
            n = c * den
            if not n:
                continue
            factors = [f"{var}[{i}]" for i in mono]
            if abs(n) != 1 or not factors:
                factors.insert(0, str(abs(n.numerator)))
            term = " * ".join(factors)
            sign = "-" if n < 0 else "+"
            parts.append(f"{'-' if sign == '-' else ''}{term}" if not parts else f"{sign} {term}")
        body = " ".join(parts) if parts else "0"
        if den != 1:
            return f"({body}) // {den}" if len(parts) == 1 else f"(({body}) // {den})"
        return body if len(parts) == 1 and " " not in body else f"({body})"

    def describe(self, names: Sequence[str]) -> str:
        out = []
        for mono, c in self.terms:
            if c:
                out.append(("" if c == 1 and mono else str(c) + ("*" if mono else "")) + "*".join(names[i] for i in mono))
        return " + ".join(out) or "0"


def monomials(k: int) -> list[tuple[int, ...]]:
    return [m for r in range(k + 1) for m in itertools.combinations(range(k), r)]


def fit_ints(points: Sequence[Sequence[int]], values: Sequence[int]) -> Optional[Poly]:
    """The multilinear polynomial through (points[i], values[i]); None when the points do not
    determine one (the caller picks a 2^k grid, which always does)."""
    k = len(points[0])
    monos = monomials(k)
    if len(points) != len(monos):
        raise ValueError(f"{len(monos)} points fit a multilinear polynomial in {k} symbols, got {len(points)}")
    rows = [[Fraction(math.prod(p[i] for i in m)) for m in monos] + [Fraction(v)] for p, v in zip(points, values)]
    n = len(monos)
    for col in range(n):  # Gauss-Jordan over the rationals: exact
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        p = rows[col][col]
        rows[col] = [x / p for x in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col]
                rows[r] = [a - f * b for a, b in zip(rows[r], rows[col])]
    return Poly(tuple((m, rows[i][n]) for i, m in enumerate(monos) if rows[i][n] != 0))


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    return [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]


@dataclass
class SourceTemplate:
    """A generated file with some integer literals replaced by polynomials in the symbols."""

    base: str  # the file at points[0]
    spans: list[tuple[tuple[int, int], tuple[int, int], Poly]]  # token start/end (row, col) in `base`
    polys: list[Poly]  # every distinct non-constant polynomial (for checks before a call)

    def render(self, names: Sequence[str] = ()) -> str:
        """The file reading `_S` (a module-level list the runtime fills before each call);
        `names` say what each symbol is, for the reader."""
        lines = self.base.splitlines(keepends=True)
        for (r0, c0), (r1, c1), poly in sorted(self.spans, key=lambda s: s[0], reverse=True):
            assert r0 == r1, "a number token spans one line"
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + poly.code() + line[c1:]
        text = "".join(lines)
        said = "; ".join(f"_S[{i}] = {n}" for i, n in enumerate(names)) or "the sizes of the call"
        line = f"_S = []  # sizes read at run time (set before each call): {said}"
        if re.search(r"^_S = \[\]", text, flags=re.M):  # a file with compiled regions declares it already
            return re.sub(r"^_S = \[\].*$", lambda _: line, text, count=1, flags=re.M)
        marker = "\nimport torch\n"
        head, _, tail = text.partition(marker)
        return head + marker + line + "\n" + tail

    def at(self, values: Sequence[int]) -> str:
        """The file with every polynomial evaluated (what generating at these sizes gives)."""
        lines = self.base.splitlines(keepends=True)
        for (r0, c0), (r1, c1), poly in sorted(self.spans, key=lambda s: s[0], reverse=True):
            v = poly(values)
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + str(int(v) if v.denominator == 1 else v) + line[c1:]
        return "".join(lines)


def same_code(a: str, b: str) -> bool:
    """Equal token for token (comments and blank lines aside)."""
    ta, tb = _tokens(a), _tokens(b)
    return len(ta) == len(tb) and all(x.type == y.type and x.string == y.string for x, y in zip(ta, tb))


def fit_sources(points: Sequence[Sequence[int]], sources: Sequence[str]) -> tuple[Optional[SourceTemplate], str]:
    """The template through the files generated at `points` (a 2^k grid), or None and why not."""
    streams = [_tokens(s) for s in sources]
    n = len(streams[0])
    for i, s in enumerate(streams[1:], 1):
        if len(s) != n:
            return None, f"the program at sizes {list(points[i])} has another structure than at {list(points[0])}"
    spans, polys = [], {}
    for j in range(n):
        toks = [s[j] for s in streams]
        first = toks[0]
        if all(t.string == first.string for t in toks):
            continue
        if any(t.type != tokenize.NUMBER for t in toks) or any(t.type != first.type for t in toks):
            return None, (f"the program at sizes {list(points[1])} differs from {list(points[0])} in more than "
                          f"sizes (line {first.start[0]}: {first.line.strip()[:100]!r})")
        try:
            values = [int(t.string) for t in toks]
        except ValueError:
            return None, f"a number that is not an integer depends on the sizes (line {first.start[0]}: " \
                         f"{first.line.strip()[:100]!r})"
        poly = fit_ints(points, values)
        if poly is None:
            return None, "the sizes chosen do not determine the program"
        spans.append((first.start, first.end, poly))
        if not poly.constant:
            polys.setdefault(poly, None)
    return SourceTemplate(sources[0], spans, list(polys)), ""
