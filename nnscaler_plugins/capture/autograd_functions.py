"""Custom `torch.autograd.Function`s kept whole through capture, with the user's own backward.

torch.export (non-strict, training IR) traces *through* `Function.apply`: the graph gets the
ops of the user's `forward`, and autograd later differentiates those ops instead of calling the
user's `backward`. For a straight-through estimator that turns an identity gradient into zeros;
for a hand-written fused loss it silently changes the numbers. So while capturing, `apply` of
every Function defined outside torch is routed through one opaque op,
`nnscaler::autograd_function(key, tensors)`, whose fake implementation runs the user's forward
on fake tensors for shapes. The converter turns that node back into a call of
`UserFunction.apply(...)` with the original arguments: the generated code calls the user's
class, so forward and backward are exactly theirs, and the op has no dimension rule unless a
plugin registers one under the class's qualified name (it runs replicated otherwise).
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.utils._pytree as pytree

OP_QUALNAME = "nnscaler::autograd_function"


class FunctionCaptureError(RuntimeError):
    """A Function that cannot be kept whole; the message names the class and what to do."""


def qualified_name(cls: type) -> str:
    """The name rules are registered under: 'package.module.ClassName'."""
    return f"{cls.__module__}.{cls.__qualname__}"


def described(cls: type) -> str:
    """The class and where it is defined, for messages."""
    try:
        import inspect
        import os

        lines, start = inspect.getsourcelines(cls)
        return f"{qualified_name(cls)} (defined at {os.path.basename(inspect.getsourcefile(cls) or '?')}:{start})"
    except (OSError, TypeError):
        return qualified_name(cls)


class FunctionTarget:
    """The op target for a user Function: calling it calls `cls.apply`.

    It carries `__module__`/`__qualname__` of `cls.apply`, so generated code names it as
    `module.ClassName.apply` when the class can be imported by that name.
    """

    def __init__(self, cls: type):
        self.cls = cls
        self.__module__ = cls.__module__
        self.__qualname__ = f"{cls.__qualname__}.apply"
        self.__name__ = qualified_name(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls.apply(*args, **kwargs)

    def __str__(self) -> str:
        return self.__name__

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionTarget) and other.cls is self.cls

    def __hash__(self) -> int:
        return hash(self.cls)

    def importable(self) -> bool:
        """Whether `module.ClassName` resolves to this class in a fresh import."""
        if "<" in self.cls.__qualname__:
            return False
        try:
            obj: Any = importlib.import_module(self.cls.__module__)
            for part in self.cls.__qualname__.split("."):
                obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - any failure means "not by name"
            return False
        return obj is self.cls


@dataclass
class _Call:
    """One `apply` seen while capturing: what to rebuild the call from."""

    cls: type
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list  # non-tensor leaves as they were, tensor positions as _SLOT
    single: bool = True  # forward returned one tensor (not a tuple)


_SLOT = object()
_CALLS: dict[str, _Call] = {}
_COUNTER = itertools.count()
_LIBRARY: Optional[torch.library.Library] = None


class _FakeCtx:
    """Enough of a FunctionCtx for an old-style `forward(ctx, ...)` run only for shapes."""

    def __init__(self, cls: type, n_inputs: int):
        self._cls = cls
        self.needs_input_grad = (True,) * n_inputs
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors: Any) -> None:
        raise FunctionCaptureError(
            f"{described(self._cls)} modifies its inputs in place (ctx.mark_dirty): an in-place custom "
            "Function cannot be kept as one op; return a new tensor from its forward instead")


def _forward(key: str, tensors: list) -> list:
    call = _CALLS[key]
    it = iter(tensors)
    args, kwargs = pytree.tree_unflatten([next(it) if leaf is _SLOT else leaf for leaf in call.leaves], call.spec)
    cls = call.cls
    with torch.no_grad():
        if torch.autograd.function._is_setup_context_defined(cls.setup_context):
            out = cls.forward(*args, **kwargs)
        else:
            out = cls.forward(_FakeCtx(cls, len(args)), *args, **kwargs)
    call.single = not isinstance(out, (tuple, list))
    outs = [out] if call.single else list(out)
    for o in outs:
        if not isinstance(o, torch.Tensor):
            raise FunctionCaptureError(
                f"{described(cls)}: forward returns {type(o).__name__}; a custom Function kept as one op "
                "must return tensors only")
    given = [t for t in tensors if t is not None]
    # An op may not hand back its input (or a view of it) as its output.
    return [o.clone() if any(o is t or o._base is t or (t._base is not None and o._base is t._base)
                             for t in given) else o for o in outs]


def _ensure_op() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    lib = torch.library.Library("nnscaler", "FRAGMENT")
    lib.define("autograd_function(str key, Tensor?[] tensors) -> Tensor[]")
    lib.impl("autograd_function", _forward, "CompositeExplicitAutograd")
    torch.library.register_fake(OP_QUALNAME, _forward, lib=lib)
    _LIBRARY = lib


def _is_user_function(cls: type) -> bool:
    mod = cls.__module__ or ""
    return not (mod == "torch" or mod.startswith("torch.") or mod.startswith("nnscaler_plugins."))


@contextlib.contextmanager
def opaque_functions() -> Iterator[None]:
    """While active, `apply` of user Functions records one opaque op instead of tracing through.

    Convert the exported program inside the block: the calls it records are forgotten on exit.
    """
    _ensure_op()
    before = set(_CALLS)
    original = torch.autograd.Function.__dict__["apply"]
    inner = original.__func__

    def apply(cls, *args, **kwargs):
        if not _is_user_function(cls):
            return inner(cls, *args, **kwargs)
        return opaque_call(cls, args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original
        for key in set(_CALLS) - before:
            del _CALLS[key]


def opaque_call(cls: type, args: tuple, kwargs: dict) -> Any:
    """Record `cls.apply(*args, **kwargs)` as one opaque op (inside `opaque_functions`); the
    library's own Functions that must stay whole (an experts layer) are recorded this way too."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    key = f"fn{next(_COUNTER)}"
    _CALLS[key] = _Call(cls, spec, [_SLOT if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
    outs = torch.ops.nnscaler.autograd_function(key, tensors)
    return outs[0] if _CALLS[key].single else tuple(outs)


def is_opaque_call(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.name() == OP_QUALNAME


def rebuild_call(args: tuple) -> tuple[FunctionTarget, tuple, dict, bool]:
    """From the opaque node's (key, tensors) -- tensors already converted to graph refs -- the
    target, the user's own args and kwargs, and whether forward returned a single tensor."""
    key, tensors = args
    call = _CALLS[key]
    it = iter(tensors)
    user_args, user_kwargs = pytree.tree_unflatten(
        [next(it) if leaf is _SLOT else leaf for leaf in call.leaves], call.spec)
    return FunctionTarget(call.cls), tuple(user_args), dict(user_kwargs), call.single
