"""Errors users see. Each names the thing that is wrong and what to do about it."""
from __future__ import annotations

from typing import Optional


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
