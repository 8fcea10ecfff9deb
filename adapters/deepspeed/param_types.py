"""The types of an optimizer's or a scheduler's parameters in a DeepSpeed config, read from the
defaults of the class that will take them: a learning rate written as "0.1" or betas as "0.9" would
otherwise reach torch as a string and fail there with a raw comparison error, after process
groups exist, and a flag written as "false" would be true."""
from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable

from .errors import DeepSpeedConfigError


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _expects(default: Any) -> tuple[Callable[[Any], bool], str] | None:
    """A check of a value against a parameter's default (None: anything goes)."""
    if isinstance(default, bool):
        return (lambda v: isinstance(v, bool)), "true or false"
    if _number(default):
        return _number, "a number"
    if isinstance(default, str):
        return (lambda v: isinstance(v, str)), "a string"
    if isinstance(default, (tuple, list)) and default and all(_number(x) for x in default):
        n = len(default)
        return (lambda v: isinstance(v, (list, tuple)) and len(v) == n and all(_number(x) for x in v)), \
            f"a list of {n} numbers"
    return None


def check_param_types(fn: Callable[..., Any], params: dict, where: str) -> None:
    """Refuse (DeepSpeedConfigError naming `where.key`, the value and the type wanted) a value of
    `params` whose type differs from the default of `fn`'s parameter of that name; parameters
    without a default, or with None, are not checked here."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    for key, value in params.items():
        p = signature.parameters.get(key)
        if p is None or p.default is inspect.Parameter.empty or value is None:
            continue
        expected = _expects(p.default)
        if expected is not None and not expected[0](value):
            raise DeepSpeedConfigError(f"{where}.{key}={value!r}: must be {expected[1]} (as its default "
                                       f"{p.default!r}), not a {type(value).__name__}")
