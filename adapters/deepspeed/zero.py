"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` for scripts that use them.

`Init` builds the model on the meta device, so no rank ever holds the whole model in memory before
the engine parallelizes it; the engine then makes each rank's pieces with the model's own
initialization. `Init(enabled=False)` does nothing, as in DeepSpeed.

A parameter no rank holds whole here carries DeepSpeed's ZeRO-3 marks, which scripts and libraries
test for (`hasattr(p, "ds_id")`, `p.ds_status == ZeroParamStatus.NOT_AVAILABLE`, `p.ds_numel`,
`p.ds_shape`): the parameters of a model built under `Init`, and, once an engine parallelized a
model, the model's parameters and the engine's pieces (`engine.module.parameters()`) that are not
the whole tensor (ZeRO-3 chunks, tensor-parallel pieces). Such a model parameter holds no values
(an empty tensor, as DeepSpeed's partitioned parameters do), so nothing reads stale weights.

`GatheredParameters(params)` gives the whole, current values of any of those (collective: every
rank enters it, as in DeepSpeed): inside the block each one *is* the whole tensor; after it, it
is this rank's piece again. Parameters of a model built under `Init` that no engine has yet are
given their values then (the modules owning them initialized from one seed all ranks agree on)
and keep them. Writing into them without `modifier_rank` does not reach the engine, as in
DeepSpeed: an error with `zero_optimization.enable_sanity_checks`, a warning without. With `modifier_rank=r`, what rank r wrote into them inside the block
is what every rank's engine trains on afterwards; without one, writing into them is an error.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from enum import Enum
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

# Engines alive in this process, so that a parameter can be traced to the engine training it.
_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()
_NEXT_ID = itertools.count()


class ZeroParamStatus(Enum):
    """DeepSpeed's `partition_parameters.ZeroParamStatus` (same members and values)."""
    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # a piece here
    INFLIGHT = 3  # being gathered (never left in this state here)


def register_engine(engine: Any) -> None:
    _ENGINES.add(engine)


def engine_of(param: torch.Tensor) -> Optional[Any]:
    for engine in list(_ENGINES):
        if engine.name_of(param) is not None:
            return engine
    return None


def mark_partitioned(param: torch.Tensor, whole_shape: torch.Size) -> None:
    """Give `param` DeepSpeed's ZeRO-3 marks: it is not the whole tensor of `whole_shape` here."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_NEXT_ID)
    param.ds_shape = torch.Size(whole_shape)
    param.ds_numel = param.ds_shape.numel()
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether `param` carries the ZeRO-3 marks (it is not whole here outside GatheredParameters)."""
    return hasattr(param, "ds_id")


def whole_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor behind `param` (its own, unless it is marked as a piece)."""
    return param.ds_shape if is_partitioned(param) else param.shape


def take_from_engine(model: torch.nn.Module) -> None:
    """A model an engine already trains, handed to another `initialize`: its parameters that hold no
    values (the engine has them in pieces) get the whole, current ones (collective)."""
    released = [p for p in model.parameters()
                if is_partitioned(p) and not p.is_meta and p.numel() == 0 and p.ds_numel > 0]
    by_engine: dict = {}
    for p in released:
        engine = engine_of(p)
        if engine is not None:
            by_engine.setdefault(id(engine), (engine, []))[1].append(p)
    for engine, params in by_engine.values():
        engine.gather_whole(params)  # kept whole: the new engine takes them from here
        for p in params:
            p.ds_status = ZeroParamStatus.AVAILABLE


class Init:
    """Build the model on the meta device (DeepSpeed partitions it as it is built; here the engine
    makes each rank's pieces when it parallelizes the model). Arguments DeepSpeed takes are accepted;
    they tune how DeepSpeed itself partitions. Parameters made inside carry the ZeRO-3 marks."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **kwargs: Any):
        if remote_device == "nvme":
            raise NotImplementedError("zero.Init(remote_device='nvme'): NVMe offload is not supported")
        self.enabled = enabled
        self.dtype = dtype
        given = config_dict_or_path if config_dict_or_path is not None else config
        self._sanity_checks = False
        if enabled and given is not None:  # only its zero_optimization.enable_sanity_checks matters here
            from .config import load_config

            zero = load_config(given).get("zero_optimization") or {}
            self._sanity_checks = bool(zero.get("enable_sanity_checks", False))
        if enabled and not dist.is_initialized():  # DeepSpeed's Init starts the process group too
            from .launch import init_distributed

            init_distributed()
        self._device: Optional[torch.device] = None
        self._old_dtype: Optional[torch.dtype] = None
        self._hook: Any = None
        if enabled and module is not None:  # Init(module=m): an existing model's parameters are marked
            for p in module.parameters():
                if p.is_meta:
                    mark_partitioned(p, p.shape)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._device = torch.device("meta")
        self._device.__enter__()
        if self.dtype is not None:
            self._old_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        sanity = self._sanity_checks

        def mark(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
            _mark_if_meta(module, name, param)
            if param is not None and param.is_meta and sanity:
                param.ds_enable_sanity_checks = True

        self._hook = torch.nn.modules.module.register_module_parameter_registration_hook(mark)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None


# Attribute holding (a weak reference to) the module a parameter made under Init was registered
# on, to initialize it when gathered before any engine has the model.
_OWNER = "_nns_init_owner"


def _mark_if_meta(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
    if param is not None and param.is_meta:
        mark_partitioned(param, param.shape)
        if not hasattr(param, _OWNER):
            setattr(param, _OWNER, weakref.ref(module))


def _materialize_loose(params: list) -> None:
    """Parameters built under Init that no engine trains yet get their values now: each owning
    module is initialized by the scheme an engine would use, from one seed every rank agrees on, so
    every rank holds the same whole tensors (collective)."""
    import nnscaler_plugins as nns

    seed = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    owners = []
    for p in params:
        ref = getattr(p, _OWNER, None)
        owner = ref() if ref is not None else None
        if owner is None:
            raise NotImplementedError("GatheredParameters: a meta parameter that was not built under zero.Init and "
                                      "belongs to no engine has no values to gather; build the model under "
                                      "deepspeed.zero.Init or pass it to deepspeed.initialize first")
        if all(o is not owner for o in owners):
            owners.append(owner)
    for owner in owners:
        # initializing swaps each tensor's contents (its Python attributes too): the marks are put back
        marks = [(q, {k: v for k, v in vars(q).items() if k.startswith("ds_") or k == _OWNER})
                 for q in owner.parameters()]
        nns.init_weights(owner, int(seed.item()))
        for q, attrs in marks:
            for k, v in attrs.items():
                setattr(q, k, v)


class GatheredParameters:
    """The whole values of `params` inside the block (collective over every rank)."""

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[torch.nn.Module] = None, enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.params = _unique(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._restore: list = []

    def _by_engine(self) -> dict:
        out: dict = {}
        for p in self.params:
            engine = engine_of(p)
            if engine is not None:
                out.setdefault(id(engine), (engine, []))[1].append(p)
        return out

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for engine, params in self._by_engine().values():
            self._restore += engine.gather_whole(params)
        loose = [p for p in self.params if engine_of(p) is None and p.is_meta]
        if loose:  # a model built under Init, before initialize: its values are made now, alike on every rank
            _materialize_loose(loose)
        for p in self.params:
            if is_partitioned(p):
                p.ds_status = ZeroParamStatus.AVAILABLE
        self._versions = [p._version for p in self.params]  # (after the gather, which writes them)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        try:
            if exc[0] is not None:
                return
            if self.modifier_rank is None:
                # Nobody was named to modify them: the change does not reach the engine (a gathered copy
                # is dropped; a whole parameter keeps it on this rank only). DeepSpeed does the same, and
                # raises with zero_optimization.enable_sanity_checks; so does this engine, and warns
                # without it.
                changed = [p for p, v in zip(self.params, self._versions) if p._version != v]
                if changed:
                    what = (f"in-place modification of {len(changed)} parameter(s) inside "
                            "zero.GatheredParameters(modifier_rank=None): no rank was named to modify them, so the "
                            "change is not what the engine trains on (dropped where the parameter is partitioned, "
                            "kept only in this rank's copy where it is whole); pass modifier_rank=<the rank that "
                            "modifies them>")
                    if any(_sanity_checks(p) for p in changed):
                        raise RuntimeError(what)
                    warnings.warn(what, stacklevel=2)
                return
            if dist.is_initialized() and dist.get_world_size() > 1:
                with torch.no_grad():  # DeepSpeed makes every rank see rank r's values, engine or not
                    for p in self.params:
                        dist.broadcast(p.data, src=self.modifier_rank)
            updates = [(engine, engine.whole_values(params)) for engine, params in self._by_engine().values()]
            self._release()
            for engine, values in updates:
                engine.apply_model_parameters(values)
        finally:
            self._release()

    def _release(self) -> None:
        """Each parameter back to this rank's piece (or to no values, for a model parameter)."""
        for release in reversed(self._restore):
            release()
        self._restore = []
        for p in self.params:
            if is_partitioned(p):
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _sanity_checks(param: torch.Tensor) -> bool:
    """Whether the config `param` comes under asks for DeepSpeed's ZeRO-3 sanity checks
    (zero_optimization.enable_sanity_checks: given to zero.Init, or to the engine training it)."""
    if getattr(param, "ds_enable_sanity_checks", False):
        return True
    engine = engine_of(param)
    return engine is not None and engine.sanity_checks


def _unique(params: list) -> list:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's hint that `module`'s forward uses a parameter of another module. The captured
    program already knows every use of every parameter; nothing to record."""


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """See register_external_parameter."""
