"""The eager executor: a ParallelModule that runs the user's own module instead of generated code.

Plans that keep whole layers on each device (dp, ZeRO 1-3, offload) need no graph: DDP, FSDP2 and
DeepSpeed run such plans on any module that runs in one process, data-dependent sizes, `.item()` and
Python control flow included. When capture fails (or `executor="eager"`), the ParallelModule runs the
model's own forward, with the same shards, reducer, ZeRO state, optimizer, checkpoints, watchdog and
non-finite checks as generated code, because the plan's Program describes the same storage
(`lower/eager.py`). What this module adds is how the user's module reaches that storage:

- Its parameters and buffers are replaced by this rank's shards (the same tensor objects; where a
  parameter is already whole on the device, the model's own), so the
  forward reads them and the backward accumulates into them; the gradient reducer's hooks on them
  reduce gradients in buckets during backward, launched in bucket order (as DDP does), so ranks whose
  forwards took different branches still issue the same collectives in the same order.
- Under ZeRO-3 each module's parameter dict hands out whole parameters while a forward runs: the first
  read of a parameter gathers it (`Zero3Params.fetch`, its whole layer in one collective, the next
  layer's gather started in the order the previous forward read them), the module that read it keeps it
  until its forward returns, and autograd keeps a reference instead of the tensor (gathered again for
  backward, gradients reduce-scattered as they come). Outside a forward the dict holds this replica's
  chunks, as FSDP2 and DeepSpeed's ZeRO-3 expose them.
- Batch norm in training normalizes with the whole global batch's statistics (the plan's
  `batch_statistics="global"`, the default), as SyncBatchNorm does, through the same kernel the
  captured path uses (`kernels/batch_norm_statistics.py`), for `nn.BatchNorm*` modules and for
  `F.batch_norm` called anywhere in the forward.

Random ops draw from the process's own generators, as the user's code under DDP does. Every replica
must run the same modules under ZeRO-3 (as FSDP2 and DeepSpeed require): a forward that gathers a layer
another replica skips waits, and the watchdog names the gather.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from nnscaler_plugins.kernels import batch_norm_statistics
from nnscaler_plugins.runtime.params_on_use import gather_units
from nnscaler_plugins.runtime.precision import for_compute

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.runtime.parallel_module import ParallelModule


class _ParametersOnUse(dict):
    """A module's `_parameters` under ZeRO-3: its chunk Parameters, and while a forward runs, each
    ZeRO-3 parameter gathered whole when read (`Module.__getattr__` reads through `__getitem__`; the
    dict's iteration, and so `parameters()` and `state_dict()`, still gives the chunks)."""

    __slots__ = ("_eager", "_keys")

    def __init__(self, items: Any, eager: "EagerExecutor", keys: dict[str, int]):
        super().__init__(items)
        self._eager = eager
        self._keys = keys

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        key = self._keys.get(name)
        if key is None or not self._eager.in_forward:
            return value
        return self._eager.whole(key)

    def items(self) -> Any:  # `named_parameters()` inside a forward (a penalty on the weights) sees them whole
        if not self._eager.in_forward:
            return super().items()
        return [(name, self[name]) for name in dict.keys(self)]

    def values(self) -> Any:
        if not self._eager.in_forward:
            return super().values()
        return [self[name] for name in dict.keys(self)]

    def __reduce__(self) -> Any:  # pickled (a deep copy of the model): a plain dict of the chunks
        return (dict, (dict(self.items()),))


class _BatchNormWhole(TorchFunctionMode):
    """`F.batch_norm` in training with the whole batch's statistics over `group` (the replicas)."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.batch_norm:
            return _functional_batch_norm(self.group, *args, **kwargs)
        return func(*args, **kwargs)


def _functional_batch_norm(group: Any, input: torch.Tensor, running_mean: Optional[torch.Tensor],
                           running_var: Optional[torch.Tensor], weight: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, training: bool = False, momentum: float = 0.1,
                           eps: float = 1e-5) -> torch.Tensor:
    """`F.batch_norm`'s arguments, to the whole-batch kernel (its own arithmetic outside training)."""
    if not training:
        return torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if running_mean is None and running_var is None:
        return batch_norm_statistics.native_batch_norm_no_stats(input, weight, bias, True, momentum, eps,
                                                                group=group)[0]
    return batch_norm_statistics.batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps,
                                            group=group)


class EagerExecutor:
    """Binds the user's `model` to a ParallelModule's shards and runs its forward (see the module doc)."""

    def __init__(self, pm: "ParallelModule", model: torch.nn.Module):
        self.pm = pm
        self.model = model
        self.in_forward = False
        self._cache: dict[int, torch.Tensor] = {}  # ZeRO-3 key -> whole parameter, while its reader runs
        self._owner: dict[int, list[int]] = {}  # id of a running module -> the keys it read first
        self._stack: list[int] = []  # ids of the modules whose forward is running, innermost last
        self._order: list[int] = []  # ZeRO-3 keys in the order this forward first read them
        self._next: dict[int, int] = {}  # the previous forward's order: key -> the key read after it
        self._hooks: list[Any] = []
        self._bn_group = self._batch_norm_group()
        by_name = {}
        for key, s in pm.program.shards.items():
            for n in (s.fqn, *s.aliases):
                by_name[n] = key
        zero3_key = pm.zero3_index if pm.zero3 is not None else {}
        for prefix, mod in model.named_modules(remove_duplicate=False):
            dot = prefix + "." if prefix else ""
            keys: dict[str, int] = {}
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                shard = pm.program.shards[by_name[dot + name]]
                mod._parameters[name] = pm.tensor_of(by_name[dot + name])
                if shard.fqn in zero3_key:
                    keys[name] = zero3_key[shard.fqn]
            for name, b in list(mod._buffers.items()):
                if b is not None and dot + name in by_name:
                    mod._buffers[name] = pm.tensor_of(by_name[dot + name])
            if keys and not isinstance(mod._parameters, _ParametersOnUse):
                mod._parameters = _ParametersOnUse(mod._parameters, self, keys)
            if self._bn_group is not None and isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                self._hooks.append(mod.register_forward_pre_hook(self._enter_batch_norm))
                self._hooks.append(mod.register_forward_hook(self._leave_batch_norm, always_call=True))
        if pm.zero3 is not None:
            for mod in dict.fromkeys(model.modules()):
                self._hooks.append(mod.register_forward_pre_hook(self._enter))
                self._hooks.append(mod.register_forward_hook(self._leave, always_call=True))
            self._units = self._gather_units()
        self._bn_modes: list[Any] = []
        # Whether the forward calls F.batch_norm outside batch-norm modules: looked at in the first training
        # forward (a mode over every torch call then); only such a forward keeps the mode afterwards.
        self._functional_bn: Optional[bool] = None if self._bn_group is not None else False

    # -- set-up ------------------------------------------------------------------------------------------
    def _batch_norm_group(self) -> Any:
        """The group batch norm's statistics are made whole over (the replicas), or None (one replica, or
        the plan's batch_statistics="local")."""
        pm = self.pm
        if pm.plan.dp <= 1 or pm.plan.knobs.batch_statistics == "local":
            return None
        return pm.groups.get(tuple(range(pm.plan.world_size)))

    def _gather_units(self) -> list[list[int]]:
        """ZeRO-3's gather units (a layer's parameters together), from the parameters' names in the
        model's order, as the captured path groups them."""
        z = self.pm.zero3
        keys = list(range(len(z.chunks)))
        fqns = [z.shards[k].fqn for k in keys]
        nbytes = [z.shards[k].numel * z.chunks[k].element_size() for k in keys]
        return [[keys[i] for i in unit] for unit in gather_units(fqns, nbytes)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- ZeRO-3: whole parameters while they are read ----------------------------------------------------
    def whole(self, key: int) -> torch.Tensor:
        """The whole parameter `key` for the running forward: gathered at its first read, kept by the
        innermost running module until its forward returns."""
        t = self._cache.get(key)
        if t is not None:
            return t
        first = key not in self._order
        t = for_compute(self.pm.zero3.fetch(key, self._next.get(key) if first else None), self.pm.plan.precision)
        if first:
            self._order.append(key)
        self._cache[key] = t
        self._owner.setdefault(self._stack[-1] if self._stack else 0, []).append(key)
        return t

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(id(module))

    def _leave(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._stack and self._stack[-1] == id(module):
            self._stack.pop()
        for key in self._owner.pop(id(module), ()):
            self._cache.pop(key, None)

    def first_key(self) -> Optional[int]:
        """The ZeRO-3 key the last forward read first (what the next one reads first)."""
        return self._order[0] if self._order else None

    # -- batch norm over the whole batch -----------------------------------------------------------------
    def _enter_batch_norm(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and self._functional_bn is not True:
            mode = _BatchNormWhole(self._bn_group)
            mode.__enter__()
            self._bn_modes.append(mode)
        else:
            self._bn_modes.append(None)

    def _leave_batch_norm(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        mode = self._bn_modes.pop() if self._bn_modes else None
        if mode is not None:
            mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def _functional_batch_norm_scope(self) -> Iterator[None]:
        """Under the whole-batch mode for the entire forward where the forward calls F.batch_norm
        outside batch-norm modules; the first training forward finds out."""
        if self._functional_bn is False or not self.model.training:
            yield
            return
        if self._functional_bn is True:
            with _BatchNormWhole(self._bn_group):
                yield
            return
        finder = _FindBatchNorm(self._bn_group)
        with finder:
            yield
        self._functional_bn = finder.outside_modules

    # -- running -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Around one call of the user's forward: ZeRO-1/2's gathers of updated weights settled first,
        ZeRO-3's gathers and saved references set up, batch norm over the whole batch."""
        pm = self.pm
        pm.param_gather.wait_all()
        z = pm.zero3
        if z is None:
            with self._functional_batch_norm_scope():
                yield
            return
        z.new_forward()
        z.gather_together(self._units)
        if self._order:
            self._next = dict(zip(self._order, self._order[1:]))
        self._order = []
        self._cache.clear()
        self._owner.clear()
        self._stack.clear()
        self.in_forward = True
        try:
            with z.forward_scope(), self._functional_batch_norm_scope():
                yield
        finally:
            self.in_forward = False
            self._cache.clear()
            self._owner.clear()
            self._stack.clear()

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The user's forward on this replica's batch, its inputs moved to this rank's device."""
        dev = self.pm.device
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dev) if t.device != dev else t, (args, kwargs))
        with self.forward_scope():
            return self.model(*args, **kwargs)


class _FindBatchNorm(_BatchNormWhole):
    """The whole-batch mode, noting whether F.batch_norm is called outside a batch-norm module's own
    forward (those run under the mode their hooks enter, which takes the call first)."""

    def __init__(self, group: Any):
        super().__init__(group)
        self.outside_modules = False

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch.nn.functional.batch_norm:
            self.outside_modules = True
        return super().__torch_function__(func, types, args, kwargs)


def eager_source(reason: str, model: torch.nn.Module) -> str:
    """What `generated_source()` says of an eagerly run module: no file, the user's own code, and why."""
    return (f"# No code was generated for this plan: every replica runs {type(model).__module__}."
            f"{type(model).__qualname__}.forward itself (the eager executor, runtime/eager_executor.py),\n"
            f"# because {reason}.\n")

