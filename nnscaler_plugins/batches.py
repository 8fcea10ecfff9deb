"""A batch as a model's forward takes it: one convention for example inputs and training batches
(a dict is keyword arguments, a tuple positional ones, a tensor the single argument), and cutting a
batch into micro-batches: every tensor whose leading dim is the batch size is split along it,
everything else is handed whole to each micro-batch.

A FlexAttention `BlockMask` in a batch (torchtitan passes its masks to forward) is carried as the
tensors it is made of (`block_mask_input.py`); a micro-batch's mask is the same mask read from the
micro-batch's first row, where the mask has a row dim.

Plans are made for the shapes of one micro-batch, so the same rule serves capture (the graph is
traced on the first micro-batch) and `train_step` (the batch is cut before it runs); pieces of
other sizes than the example's run the same program (runtime/batch_shapes.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from nnscaler_plugins.block_mask_input import BlockMaskInput, as_inputs
from nnscaler_plugins.errors import PlanError


def normalize_inputs(args: Any, kwargs: Optional[dict]) -> tuple[tuple, dict]:
    """One convention for example inputs everywhere: dict -> kwargs, tensor -> single arg."""
    kwargs = dict(kwargs or {})
    if isinstance(args, dict):
        kwargs.update(args)
        args = ()
    elif isinstance(args, torch.Tensor):
        args = (args,)
    elif isinstance(args, list):
        args = tuple(args)
    return as_inputs(tuple(args)), as_inputs(kwargs)


def input_at(args: tuple, kwargs: dict, path: tuple) -> Any:
    """The leaf of a call's inputs at a captured graph input's path: ("args", i, ...) or
    ("kwargs", name, ...), then keys and indices down (the tensors a block mask is made of by
    their index). Raises KeyError / IndexError where the call lacks it."""
    where, key, *rest = path
    x = args[key] if where == "args" else kwargs[key]
    for k in rest:
        x = x.child(k) if isinstance(x, BlockMaskInput) else x[k]
    return x


def batch_size(batch: Any) -> Optional[int]:
    """The leading dim of the batch's first tensor (None when it holds no tensor with a dim)."""
    for leaf in pytree.tree_leaves(as_inputs(batch), is_leaf=lambda x: isinstance(x, BlockMaskInput)):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return int(leaf.shape[0])
    return None


def resolve_micro_batches(batch: Any, micro_batches: Optional[int] = None,
                          micro_batch_size: Optional[int] = None) -> int:
    """The number of micro-batches from either spelling, checked against the batch."""
    if micro_batches is None and micro_batch_size is None:
        return 1
    for name, v in (("micro_batches", micro_batches), ("micro_batch_size", micro_batch_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise PlanError(f"{name}={v!r}: must be a positive integer, not a {type(v).__name__}")
    size = batch_size(batch) if batch is not None else None
    if micro_batch_size is not None:
        if size is None:
            raise PlanError("micro_batch_size needs example inputs with a batch dim; pass micro_batches= instead")
        if int(micro_batch_size) < 1 or size % int(micro_batch_size):
            raise PlanError(f"micro_batch_size={micro_batch_size} does not divide the batch of {size}")
        from_size = size // int(micro_batch_size)
        if micro_batches is not None and int(micro_batches) != from_size:
            raise PlanError(f"micro_batches={micro_batches} and micro_batch_size={micro_batch_size} disagree for a "
                            f"batch of {size} (that is {from_size} micro-batches)")
        return from_size
    m = int(micro_batches)
    if m < 1:
        raise PlanError(f"micro_batches must be >= 1 (got {m})")
    if size is not None and size % m:
        raise PlanError(f"micro_batches={m} does not divide the batch of {size}")
    return m


def split_batch(batch: Any, micro_batches: int) -> list[Any]:
    """`micro_batches` pieces of the batch, in order. A batch that does not divide evenly (the
    last of a loader) is cut as evenly as it goes, the first pieces one sample larger; each
    piece's loss is then weighted by what it holds (see runtime/loss_items.py)."""
    if micro_batches == 1:
        return [batch]
    size = batch_size(batch)
    if size is None or size < micro_batches:
        raise PlanError(f"a batch of {size} samples cannot be cut into {micro_batches} micro-batches: the plan "
                        f"needs at least {micro_batches} samples per step and data-parallel replica")
    small, extra = divmod(size, micro_batches)
    bounds = [0]
    for i in range(micro_batches):
        bounds.append(bounds[-1] + small + (1 if i < extra else 0))

    batch = as_inputs(batch)

    def cut(x: Any, i: int) -> Any:
        if isinstance(x, BlockMaskInput):
            return x.rows(bounds[i], bounds[i + 1]) if x.context.rows == size else x
        return x[bounds[i]:bounds[i + 1]] if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == size else x

    def piece(i: int) -> Any:
        return pytree.tree_map(lambda x: cut(x, i), batch, is_leaf=lambda x: isinstance(x, BlockMaskInput))

    return [piece(i) for i in range(micro_batches)]


class ForwardArguments:
    """What a model's forward takes, read once from its signature, so that a batch key the
    captured program never reads is not dropped without a word: eager PyTorch raises on a keyword
    the forward does not take, and uses one it does take. `named` is None when the signature
    cannot be read (a model built from C code, or no model given)."""

    def __init__(self, model: Any):
        import inspect

        self.owner = type(model).__name__ if model is not None else "the model"
        self.named: Optional[set[str]] = None
        self.defaults: dict[str, Any] = {}
        self.var_keyword = False
        self.var_positional = False
        self._warned: set[str] = set()
        try:
            params = inspect.signature(model.forward).parameters.values()
        except (AttributeError, TypeError, ValueError):
            return
        self.named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        self.var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)

    def check(self, args: tuple, kwargs: dict, captured_kwargs: set, captured_args: int) -> None:
        """Refuse (TypeError, naming the key) a batch entry holding tensors that the captured
        program does not read: one the forward does not take (eager raises too), or one it takes
        that the example inputs did not have as a tensor (the program was traced without it, eager
        would use it). A keyword the forward would only collect in `**kwargs` is passed through as
        eager passes it, with a warning once that the captured program does not read it."""
        for key, value in kwargs.items():
            if key in captured_kwargs or not _holds_tensor(value):
                continue
            if self.named is not None and key not in self.named:
                if self.var_keyword:
                    if key not in self._warned:
                        self._warned.add(key)
                        import warnings

                        warnings.warn(f"batch key {key!r} is not in the captured program (the example inputs had "
                                      f"no {key!r}); {self.owner}.forward takes **kwargs, so it is passed as eager "
                                      f"would, and the program reads nothing of it: give the example inputs a "
                                      f"{key!r} if the model uses it", stacklevel=4)
                    continue
                takes = ", ".join(sorted(self.named)) or "no keyword arguments"
                raise TypeError(f"batch key {key!r} is not an argument of {self.owner}.forward (it takes: {takes}); "
                                f"eager PyTorch refuses it too: drop it from the batch")
            raise TypeError(f"batch key {key!r} was not in the example inputs, so the captured program does not "
                            f"read it (eager PyTorch would use it); capture with an example that has {key!r}, or "
                            f"drop it from the batch (captured inputs: {', '.join(sorted(captured_kwargs)) or 'none'})")
        extra = [i for i in range(captured_args, len(args)) if _holds_tensor(args[i])]
        if extra:
            raise TypeError(f"the batch has {len(args)} positional inputs, the example had {captured_args}; the "
                            f"captured program does not read input {extra[0]}: capture with an example that has it, "
                            "or drop it from the batch")

    def unlike_example(self, args: tuple, kwargs: dict, settings: dict) -> Optional[str]:
        """What in this call the captured program would not do as eager does: a plain setting (a
        number, a flag, a string, None) given another value than the example's -- `settings`, the
        example's own (`capture.example_settings`) -- or, absent from the example, another value
        than the forward's default (a keyword only `**kwargs` collects: any value but None). The
        program was traced with the example's, as a Python branch on it is; None when all agree."""
        for key, value in kwargs.items():
            if not _is_setting(value):
                continue
            where = ("kwargs", key)
            if where in settings:
                traced, said = settings[where], "the example's"
            elif self.named is not None and key in self.defaults:
                traced, said = self.defaults[key], f"{self.owner}.forward's default"
            elif self.named is not None and key not in self.named and self.var_keyword:
                traced, said = None, "absent from the example, so never read"
            else:
                continue
            if not _same_setting(value, traced):
                return (f"batch key {key}={value!r} is not what the captured program was traced with "
                        f"({said}: {traced!r}); eager PyTorch would run the model with {value!r}")
        for where, traced in settings.items():  # given to the example, left out here: the forward's default
            if where[0] != "kwargs" or where[1] in kwargs or where[1] not in self.defaults:
                continue
            default = self.defaults[where[1]]
            if _is_setting(default) and not _same_setting(default, traced):
                return (f"batch key {where[1]!r} is left out, so eager PyTorch would run the model with its default "
                        f"{default!r}; the captured program was traced with the example's {traced!r}")
        for i, value in enumerate(args):
            where = ("args", i)
            if where in settings and _is_setting(value) and not _same_setting(value, settings[where]):
                return (f"positional input {i} is {value!r}, the captured program was traced with "
                        f"{settings[where]!r}; eager PyTorch would run the model with {value!r}")
        return None


_SETTING_TYPES = (bool, int, float, str, type(None))


def _is_setting(value: Any) -> bool:
    return isinstance(value, _SETTING_TYPES)


def _same_setting(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # True is not 1, 1 is not 1.0: each may pick another path


def example_settings(args: tuple, kwargs: dict) -> dict[tuple, Any]:
    """The plain settings (numbers, flags, strings, None) among a forward's top-level inputs, by
    path (("kwargs", key) / ("args", i)): a captured program holds them as constants."""
    out: dict[tuple, Any] = {("args", i): v for i, v in enumerate(args) if _is_setting(v)}
    out.update({("kwargs", k): v for k, v in kwargs.items() if _is_setting(v)})
    return out


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, BlockMaskInput)):
        return True
    if isinstance(value, (dict, list, tuple)):
        return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))
    return False
