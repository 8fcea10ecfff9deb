"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` for scripts that use them.

`Init` builds the model on the meta device, so no rank ever holds the whole model in memory before
the engine parallelizes it; the engine then makes each rank's pieces with the model's own
initialization. `Init(enabled=False)` does nothing, as in DeepSpeed.

`GatheredParameters(params)` gives the whole, current values of parameters of a model an engine
trains (collective: every rank enters it, as in DeepSpeed); with `modifier_rank=r`, what rank r
wrote into them inside the block is what every rank's engine trains on afterwards.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

# Engines alive in this process, so that a parameter can be traced to the engine training it.
_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    _ENGINES.add(engine)


def engine_of(param: torch.Tensor) -> Optional[Any]:
    for engine in list(_ENGINES):
        if engine.name_of(param) is not None:
            return engine
    return None


class Init:
    """Build the model on the meta device (DeepSpeed partitions it as it is built; here the engine
    makes each rank's pieces when it parallelizes the model). Arguments DeepSpeed takes are accepted;
    they tune how DeepSpeed itself partitions."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **kwargs: Any):
        if remote_device == "nvme":
            raise NotImplementedError("zero.Init(remote_device='nvme'): NVMe offload is not supported")
        self.enabled = enabled
        self.dtype = dtype
        if enabled and not dist.is_initialized():  # DeepSpeed's Init starts the process group too
            from .launch import init_distributed

            init_distributed()
        self._device: Optional[torch.device] = None
        self._old_dtype: Optional[torch.dtype] = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._device = torch.device("meta")
        self._device.__enter__()
        if self.dtype is not None:
            self._old_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None


class GatheredParameters:
    """The whole values of `params` inside the block (collective over every rank)."""

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[torch.nn.Module] = None, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def _by_engine(self) -> dict:
        out: dict = {}
        for p in self.params:
            engine = engine_of(p)
            if engine is not None:
                out.setdefault(id(engine), (engine, []))[1].append(p)
        return out

    def __enter__(self) -> "GatheredParameters":
        if self.enabled:
            for engine, params in self._by_engine().values():
                engine.refresh_model_parameters(params)
        self._versions = [p._version for p in self.params]  # (after the refresh, which writes them)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or exc[0] is not None:
            return
        if self.modifier_rank is None:
            # Nobody was named to modify them: a change would stay on this rank's copy (or be lost),
            # and ranks would train on different weights. DeepSpeed's sanity checks raise here too.
            changed = [i for i, (p, v) in enumerate(zip(self.params, self._versions)) if p._version != v]
            if changed:
                raise RuntimeError(f"in-place modification of {len(changed)} parameter(s) inside "
                                   "zero.GatheredParameters(modifier_rank=None): no rank was named to modify them, "
                                   "so the change would not reach the engine; pass modifier_rank=<the rank that "
                                   "modifies them>")
            return
        many = dist.is_initialized() and dist.get_world_size() > 1
        for engine, params in self._by_engine().values():
            if many:
                for p in params:
                    dist.broadcast(p.data, src=self.modifier_rank)
            engine.apply_model_parameters(params)
        if many:
            for p in self.params:  # parameters of no engine: DeepSpeed still makes every rank see rank r's values
                if engine_of(p) is None:
                    dist.broadcast(p.data, src=self.modifier_rank)
