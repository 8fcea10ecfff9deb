"""A drop-in for `import deepspeed` in training scripts: the same `initialize`, config and engine
methods, run by this project's plans instead of DeepSpeed.

    from nnscaler_plugins.adapters import deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json",
                                                                model_parameters=model.parameters())

The config is read with DeepSpeed's meaning; keys this engine cannot honour are refused or warned
about by name (the table is `keys.py`). An optional "nnscaler" section picks the plan:
`{"nnscaler": {"plan": "tp"}}`, `{"plan": "1f1b", "pp": 2}`, `{"plan": "auto"}`; data parallel
otherwise. Importing this module never imports DeepSpeed itself.

DeepSpeed's module paths that scripts import from resolve here too (`deepspeed.comm`,
`deepspeed.accelerator`, `deepspeed.runtime.lr_schedules`, `deepspeed.runtime.zero`,
`deepspeed.ops.adam`, `deepspeed.utils.zero_to_fp32`, `deepspeed.checkpoint.utils`, `deepspeed.pipe`,
`deepspeed.moe.layer`, `deepspeed.moe.utils`, `deepspeed.compression.helper`), each holding
this engine's objects under DeepSpeed's names.

The built-in config translation is a plugin: `adapters/deepspeed_hooks.py` implements the
`nnscaler_translate_deepspeed_config` hook and is registered as `builtin_deepspeed` like any other
plugin, without importing this package.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plugins import get_plugin_manager
from nnscaler_plugins.session import Session

from .config import (
    DeepSpeedConfigError,
    Settings,
    load_config,
    resolve_batch,
    translate,  # noqa: F401 - importable from here as before
)
from .checkpoint import DS_VERSION
from .engine import DeepSpeedEngine
from .errors import ZeRORuntimeException
from .launch import add_config_arguments, init_distributed
from .optimizers import build_optimizer
from .pipeline_module import PipelineModule, pipeline_plan
from .schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from . import accelerator, checkpoint, comm, compression, moe, ops, pipe, runtime, utils, zero
from .. import deepspeed_hooks
from .accelerator import get_accelerator
from .zero_optimizer import ZeroOptimizer

__all__ = ["initialize", "settings_of", "plan_session", "parallel_degrees", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "DeepSpeedConfigError",
           "ZeRORuntimeException", "checkpoint", "zero", "utils", "comm", "ops", "runtime", "accelerator", "moe",
           "pipe", "compression",
           "get_accelerator", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]

PLUGIN_NAME = deepspeed_hooks.PLUGIN_NAME

# The DeepSpeed release whose behaviour (config, engine, checkpoint layout) this drop-in follows,
# under the names DeepSpeed's version attributes have; there is no DeepSpeed source tree behind it.
__version__ = DS_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in DS_VERSION.split("."))
__git_hash__ = None
__git_branch__ = None


def settings_of(config: dict) -> Settings:
    """The engine's settings from a DeepSpeed config dict, translated by the `nnscaler_translate_deepspeed_config`
    hook (the built-in translation unless a plugin answers first). The plan it names is checked by
    `plan_session`."""
    pm = get_plugin_manager()
    # Imported directly while entry points are switched off: the built-in still applies, unless
    # it was blocked by name.
    if not pm.is_registered(deepspeed_hooks) and not pm.has_plugin(PLUGIN_NAME) and not pm.is_blocked(PLUGIN_NAME):
        pm.register(deepspeed_hooks, name=PLUGIN_NAME)
    result = pm.hook.nnscaler_translate_deepspeed_config(config=config)
    if result is None:
        raise DeepSpeedConfigError(f"no plugin translated the DeepSpeed config (the built-in {PLUGIN_NAME!r} is "
                                   "blocked); unblock it or install a plugin implementing "
                                   "nnscaler_translate_deepspeed_config")
    return result if isinstance(result, Settings) else Settings(**result)


#: How messages name where the plan and its options were written.
WHERE = "the DeepSpeed config's 'nnscaler' section"


def plan_session(settings: Settings) -> Session:
    """The job's one `Session`: the plan the config names, resolved once and its options checked
    (whichever plugin translated the config), before the process group is touched. The training
    fields (ZeRO stage, precision, offload) are the config's own sections'."""
    if not isinstance(settings.plan, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"nnscaler.plan must be a strategy name or a plan file, got {settings.plan!r}")
    options = dict(settings.plan_options, zero=settings.zero_stage, precision=settings.precision)
    if settings.offload is not None:
        options["offload"] = settings.offload
    # a non-finite step is the engine's to handle as DeepSpeed does (fp16: the loss scaler skips it and
    # lowers the scale; bf16 / fp32: counted as an overflow); the nnscaler section may still ask otherwise
    options.setdefault("on_nonfinite", "ignore")
    try:
        return Session(settings.plan, where=WHERE, **options)
    except (PlanError, FileNotFoundError) as e:
        raise DeepSpeedConfigError(str(e)) from None


def parallel_degrees(session: Session, world_size: int) -> tuple[int, int]:
    """(ranks per model replica, data-parallel size) of the session's plan on `world_size` ranks,
    before the plan exists: the batch sizes and the data loader need the data-parallel size at
    initialize."""
    try:
        return session.source.degrees(world_size, session.options)
    except PlanError as e:
        shown = {k: v for k, v in session.options.items() if k not in ("zero", "precision", "offload", "on_nonfinite")}
        raise DeepSpeedConfigError(f"nnscaler section {dict(plan=session.source.name, **shown)}: {e}") from None


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None, config: Union[str, os.PathLike, dict, None] = None,
               mesh_param: Any = None, config_params: Optional[dict] = None, example_inputs: Any = None
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's `initialize`: returns (engine, optimizer, training_dataloader, lr_scheduler).

    `optimizer` and `lr_scheduler` may be objects or callables (params -> optimizer, optimizer ->
    scheduler) and take precedence over the config's sections, as in DeepSpeed. The config is
    checked whole before the process group is touched.

    `example_inputs` (this engine's addition: what one forward takes, per the project's convention)
    lets the model be parallelized here; without it the model is parallelized at the script's first
    `engine(...)`, on what that call passes (nothing guesses the inputs from `training_data`, which
    gives the loader only, as in DeepSpeed), and every engine method works before that.
    """
    assert model is not None, "deepspeed.initialize requires a model"
    raw = load_config(config, config_params, args)
    settings = settings_of(raw)
    if isinstance(model, PipelineModule):  # DeepSpeed's pipeline model: its stages become a pipeline plan
        settings.plan, settings.plan_options = pipeline_plan(model, settings.plan, settings.plan_options,
                                                             named="nnscaler" in raw)
    session = plan_session(settings)
    if not isinstance(model, torch.nn.Module):
        raise DeepSpeedConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise DeepSpeedConfigError("mpu= (Megatron's model-parallel unit) is not supported: the plan decides model "
                                   "parallelism; use the config's nnscaler section, e.g. {'plan': 'tp'}")
    if mesh_param is not None:
        raise DeepSpeedConfigError("mesh_param= is not supported: the plan decides the device mesh")
    if optimizer is not None and settings.optimizer is not None:
        warnings.warn(f"an optimizer was passed to initialize, so the config's optimizer section "
                      f"({settings.optimizer['type']}) is not used (DeepSpeed does the same)", stacklevel=2)
    if lr_scheduler is not None and settings.scheduler is not None:
        warnings.warn(f"an lr_scheduler was passed to initialize, so the config's scheduler section "
                      f"({settings.scheduler['type']}) is not used (DeepSpeed does the same)", stacklevel=2)

    if settings.zero_stage in (1, 2):  # DeepSpeed's ZeRO-1/2 optimizer asserts it
        assert settings.allgather_bucket_size % 2 == 0, (
            "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2 ")
    if _asserted_scheduler(lr_scheduler):  # DeepSpeed asserts it too
        assert isinstance(optimizer, torch.optim.Optimizer), (
            f"Client Optimizer (type = {type(optimizer)} is not instantiated but Client LR Scheduler is "
            "instantiated: a client lr_scheduler object needs the client optimizer object it was made on "
            "(pass optimizer=)")

    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    rank, world = dist.get_rank(), dist.get_world_size()
    unit, dp = parallel_degrees(session, world)
    resolve_batch(settings, dp)

    if optimizer is not None and settings.client_optimizer_refused:  # DeepSpeed raises it here too
        raise ZeRORuntimeException(
            f"a client optimizer ({type(optimizer).__name__}) under zero_optimization.offload_optimizer: DeepSpeed "
            "refuses it while zero_force_ds_cpu_optimizer is true (its default), and so does this engine; set an "
            "optimizer in the config, or set \"zero_force_ds_cpu_optimizer\": false to step this one on the host")
    params = _without_empty_groups(list(model_parameters) if model_parameters is not None
                                   else list(model.parameters()))
    opt = _make_optimizer(optimizer, settings, params)
    if isinstance(opt, torch.optim.Optimizer):  # DeepSpeed drops a param group with no params
        opt.param_groups[:] = [g for g in opt.param_groups if len(g["params"])]
    if opt is not None and (settings.zero_stage > 0 or settings.precision != "fp32"):
        opt = ZeroOptimizer(opt)  # DeepSpeed hands back its ZeRO / mixed-precision wrapper here too
    sched = _make_scheduler(lr_scheduler, settings, opt)
    _warn_if_detached(sched, opt)
    engine = DeepSpeedEngine(model, settings, raw, session=session, optimizer=opt, lr_scheduler=sched, rank=rank,
                             world_size=world, unit_size=unit, dp_size=dp)
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    # `training_data` gives the loader only, as in DeepSpeed: what the model takes is what the script's
    # first `engine(...)` passes it (a batch from the loader may be [images, labels] for a forward(x)).
    if example_inputs is not None:
        engine.parallelize(example_inputs)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _asserted_scheduler(scheduler: Any) -> bool:
    """Whether DeepSpeed 0.19.8 asserts that this client scheduler came with its optimizer object:
    it checks `isinstance(scheduler, torch.optim.lr_scheduler._LRScheduler)`, the deprecated base
    that torch's own schedulers (LambdaLR, StepLR, OneCycleLR, ...) no longer derive from, so in
    practice only schedulers written on that old base are checked; any other object is taken as
    it is."""
    old_base = getattr(torch.optim.lr_scheduler, "_LRScheduler", None)
    return old_base is not None and isinstance(scheduler, old_base)


def _warn_if_detached(scheduler: Any, optimizer: Any) -> None:
    """A client scheduler made on another optimizer than the engine's steps that optimizer, not the
    engine's (DeepSpeed takes it all the same): say so, since the learning rate will not follow it."""
    bound = getattr(scheduler, "optimizer", None)
    if bound is None or optimizer is None:
        return
    engine_side = {id(optimizer), id(getattr(optimizer, "inner", optimizer))}
    if id(bound) not in engine_side:
        warnings.warn(f"the lr_scheduler ({type(scheduler).__name__}) was made on an optimizer the engine does not "
                      "step, so it will not change the engine's learning rate; make it on the optimizer passed to "
                      "initialize (or pass a callable optimizer -> scheduler)", stacklevel=3)


def _without_empty_groups(params: list) -> list:
    """model_parameters as DeepSpeed takes them: param groups with no params left out."""
    out = []
    for p in params:
        if isinstance(p, dict) and not isinstance(p.get("params"), torch.Tensor):
            p = dict(p, params=list(p.get("params", ())))
            if not p["params"]:
                continue
        out.append(p)
    return out


def _make_optimizer(given: Any, settings: Settings, params: list) -> Any:
    if given is not None:
        if isinstance(given, torch.optim.Optimizer):
            return given
        if callable(given):
            return given(params)
        raise DeepSpeedConfigError(f"optimizer must be a torch optimizer or a callable making one, got "
                                   f"{type(given).__name__}")
    if settings.optimizer is None:
        return None
    return build_optimizer(settings.optimizer["type"], settings.optimizer["params"], params,
                           cpu_optimizer=settings.offload is not None)


def _make_scheduler(given: Any, settings: Settings, optimizer: Any) -> Any:
    if given is not None:
        return given(optimizer) if callable(given) and not hasattr(given, "step") else given
    if settings.scheduler is None:
        return None
    if optimizer is None:
        raise DeepSpeedConfigError(f"the config has a scheduler ({settings.scheduler['type']}) but no optimizer; add "
                                   "an optimizer section or pass optimizer=")
    return build_scheduler(settings.scheduler["type"], settings.scheduler["params"], optimizer)
