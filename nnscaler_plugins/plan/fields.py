"""Typed reading of the values in a plan file (and of the few call arguments read the same way).

A plan file is edited by hand: a degree written as "2", a `splits` that is not a list, devices as
strings. Read with plain `int(...)` / `list(...)`, such values either fail deep inside Python
("invalid literal for int()", "'int' object is not iterable") or, worse, are converted silently
(`int(1.5)` is 1). Each reader here takes the value and the field's path in the file, and either
returns the value in its type or raises PlanError naming the field, the value and what is allowed.
JSON's own types are taken as they are: an integer is an int (not a bool, not a float, not a string).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from nnscaler_plugins.errors import PlanError

T = TypeVar("T")


def _refuse(field: str, value: Any, allowed: str) -> PlanError:
    return PlanError(f"{field} = {value!r}: must be {allowed}")


def _kind(value: Any) -> str:
    """What a JSON reader would call `value`'s type, for a message."""
    return {bool: "true/false", int: "an integer", float: "a float", str: "a string", list: "a list",
            tuple: "a list", dict: "an object", type(None): "null"}.get(type(value), f"a {type(value).__name__}")


def integer(value: Any, field: str, minimum: Optional[int] = None) -> int:
    """`value` as an int (at least `minimum`); a bool, a float or a string is refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        what = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise _refuse(field, value, f"{what} (a JSON number without quotes), not {_kind(value)}")
    if minimum is not None and value < minimum:
        raise _refuse(field, value, f"an integer >= {minimum}")
    return value


def optional_integer(value: Any, field: str, minimum: Optional[int] = None) -> Optional[int]:
    return None if value is None else integer(value, field, minimum)


def text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _refuse(field, value, f"a string, not {_kind(value)}")
    return value


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise _refuse(field, value, f"true or false, not {_kind(value)}")
    return value


def mapping(value: Any, field: str, optional: bool = False) -> dict:
    """`value` as a dict (an empty one for None when `optional`)."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise _refuse(field, value, f"a JSON object, not {_kind(value)}")
    return value


def sequence(value: Any, field: str, item: Optional[Callable[[Any, str], T]] = None,
             length: Optional[int] = None) -> list:
    """`value` as a list, each item read by `item(value, its field)` when given."""
    if not isinstance(value, (list, tuple)):
        raise _refuse(field, value, f"a JSON list, not {_kind(value)}")
    if length is not None and len(value) != length:
        raise _refuse(field, value, f"a list of {length}")
    return [x if item is None else item(x, f"{field}[{i}]") for i, x in enumerate(value)]


def world_size(value: Any, field: str = "world_size", required: bool = False) -> Optional[int]:
    """A world size given to an entry point: an int >= 1, or None (the plan's or the job's) where
    it is not `required`."""
    if value is None:
        if required:
            raise PlanError(f"{field}=None: give the number of processes the plan is for (a positive integer)")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{field}={value!r}: must be a positive integer, the number of processes "
                        f"(not {_kind(value)})")
    if value < 1:
        raise PlanError(f"{field}={value!r}: must be a positive integer, the number of processes")
    return value
