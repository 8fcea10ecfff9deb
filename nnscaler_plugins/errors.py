"""Errors users see. Each names the thing that is wrong and what to do about it."""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional, Sequence


class PlanError(ValueError):
    """A plan that cannot be executed exactly. Raised before any process starts.

    `op` and `where` name the offending op and its source line when there is one.
    """

    def __init__(self, message: str, op: Optional[str] = None, where: Optional[str] = None):
        self.op = op
        self.where = where
        prefix = f"{where}: " if where else (f"{op}: " if op else "")
        super().__init__(prefix + message)


class PlanFormatWarning(UserWarning):
    """A plan file written by an earlier version was migrated when it was loaded (saving it again
    writes the current format)."""


def refuse_unknown(names: Iterable[Any], allowed: Sequence[str], what: str, where: str = "") -> None:
    """Raise PlanError naming each of `names` not in `allowed` with the closest valid one (a key of a
    plan file, a knob, a mesh axis: a misspelt name is refused, never silently ignored)."""
    unknown = [k for k in names if k not in allowed]
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), list(allowed), n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise PlanError(f"{where + ': ' if where else ''}unknown {what}(s) {', '.join(hints)}; valid: {', '.join(allowed)}")


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients held a NaN or an infinity; raised on every rank at the same step,
    before the optimizer changed any weight (the plan's `on_nonfinite="raise"`, the default).

    `step` counts the optimizer steps tried so far (from 1); `op` names the first op in program
    order whose output was not finite (with its model source line) when a re-run of the step's
    forward found one, and `rank` the rank that computed it; `gradients` lists the parameters
    whose gradients were not finite, with the ranks holding them.
    """

    def __init__(self, message: str, step: Optional[int] = None, op: Optional[str] = None,
                 rank: Optional[int] = None, gradients: tuple = ()):
        self.step = step
        self.op = op
        self.rank = rank
        self.gradients = tuple(gradients)
        super().__init__(message)

    def __reduce__(self):  # pickles with its fields (errors travel between processes)
        return (type(self), (self.args[0], self.step, self.op, self.rank, self.gradients))
