"""Times and sizes as people read them (850 µs, 40.4 ms, 9.2 MiB, 38.5 GiB): one wording for messages,
plans' explanations, tables and pictures."""
from __future__ import annotations

import math
from typing import Sequence

KiB = 1024

UNITS_S = ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s"), (60.0, "min"))
UNITS_B = ((1, "B"), (KiB, "KiB"), (KiB ** 2, "MiB"), (KiB ** 3, "GiB"), (KiB ** 4, "TiB"))


def unit_for(x: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The largest unit in which `x` is at least 1 (the smallest for 0)."""
    best = units[0]
    for scale, name in units:
        if abs(x) >= scale:
            best = (scale, name)
    return best


def number(v: float) -> str:
    """Three significant digits at most, no trailing zeros: 40.4, 9.25, 120, 0.5."""
    if v == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
    text = f"{v:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_seconds(s: float) -> str:
    """A time as people read it: 850 µs, 40.4 ms, 1.2 s, 3.1 min."""
    if s == 0:
        return "0"
    scale, name = unit_for(s, UNITS_S)
    return f"{number(s / scale)} {name}"


def fmt_bytes(b: float) -> str:
    """Bytes as people read them: 512 B, 9.2 MiB, 38.5 GiB."""
    if b == 0:
        return "0"
    scale, name = unit_for(b, UNITS_B)
    return f"{number(b / scale)} {name}"
