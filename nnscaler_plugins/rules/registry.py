"""Where built-in rules register themselves: the `@rule` decorator and the keys of the table.

The op families (elementwise.py, matmul.py, ...) import this module, never the table, so the table
can load the families without the two importing each other.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from nnscaler_plugins.capture.autograd_functions import qualified_name
from nnscaler_plugins.rules.signature import OpCall, Signature

RuleFn = Callable[[OpCall], Optional[Signature]]

BUILTIN: dict[str, RuleFn] = {}


def op_key(target: Any) -> str:
    """The table's key for an op: 'aten.linear.default' for aten overloads; a custom autograd
    Function (its class, or the op capture made of it) is keyed by 'module.ClassName'."""
    if isinstance(target, str):
        return target
    if isinstance(target, type) and issubclass(target, torch.autograd.Function):
        return qualified_name(target)
    return str(target)


# In-place ops whose functional form has another name than the one without the trailing '_'.
_FUNCTIONAL_OF = {"aten.copy_.default": "aten.copy.default", "aten.index_put_.default": "aten.index_put.default"}


def functional_key(key: str) -> Optional[str]:
    """The functional op an in-place aten op computes ('aten.add_.Tensor' -> 'aten.add.Tensor'),
    or None when `key` is not an in-place aten op. Its rule is the in-place op's rule: the pieces
    run the in-place op on their own chunks, which compute what the functional op's pieces do."""
    if key in _FUNCTIONAL_OF:
        return _FUNCTIONAL_OF[key]
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_") and not parts[1].startswith("_"):
        return f"aten.{parts[1][:-1]}.{parts[2]}"
    return None


def rule(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    """Register a built-in rule for one or more overloads (objects or 'aten.x.overload' strings)."""

    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            BUILTIN[op_key(t)] = fn
        return fn

    return deco
