"""The behaviour of the Lightning strategy "nnscaler", written once for both Lightning namespaces.

`lightning.pytorch` and `pytorch_lightning` are separate copies of Lightning and a Trainer accepts
only a subclass of its own namespace's `Strategy`, so `adapters.lightning` combines this mixin with
each namespace's `ParallelStrategy`. Everything namespace-specific is imported through `self._ns`
inside methods, which is also why this module imports no Lightning at all.

How a LightningModule is run: the strategy parallelizes one submodule of it (the model whose forward
`training_step` calls, found automatically or named by `module_attr=`), captured at its first call
inside the user's own first step, on what that step passes it (`first_call`): nothing of the
user's runs outside Lightning's loop. That attribute is then replaced by a `PlannedModel` (which
reads the plain model's attributes through, `self.layer.weight` giving this rank's piece), and the
optimizers `configure_optimizers` built from the plain parameters are pointed at the planned ones,
so `training_step`, `configure_optimizers`, logging and Lightning's loops keep working unchanged. A model built in `configure_model` (Lightning's hook for large models) is built on
the meta device and each rank makes only its own shards (see `tensor_init_context`). Plans that run whole steps (pipelines, micro-batches) run forward and backward
inside the model call and hand back the loss; Lightning's own backward on it then adds the gradients
the step made (see `lightning_model`).
"""
from __future__ import annotations

import contextlib
import datetime
import difflib
import gc
import importlib
import inspect
import os
import signal
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import first_call
from .lightning_model import PlannedModel, mode_dependent_modules
from .plan_choice import PlanLike, check_plan, check_training_state, session_for


def _check_own_keywords(plan_options: dict) -> None:
    """A misspelt keyword of the strategy itself (`state_dict_typ=`) would otherwise be read as a plan
    option and refused without pointing at the keyword meant."""
    own = [p for p in inspect.signature(NNScalerStrategyMixin.__init__).parameters
           if p not in ("self", "plan", "plan_options")]
    for key in plan_options:
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.8)
        if close:
            raise TypeError(f"NNScalerStrategy got an unexpected keyword {key!r} (did you mean {close[0]!r}?)")


#: The environment variable naming the generated-code cache when `cache_dir=` is not given.
CACHE_ENV = "NNS_CACHE_DIR"


def generated_code_dir(cache_dir: Optional[str], default_root_dir: Optional[str]) -> str:
    """Where the generated code of a plan is cached: `cache_dir=`, else $NNS_CACHE_DIR, else
    `.nnscaler_cache` under the Trainer's `default_root_dir` -- beside Lightning's own logs and
    checkpoints, never in whatever directory the script happens to start in."""
    if cache_dir is not None:
        return str(cache_dir)
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    return os.path.join(default_root_dir or os.getcwd(), ".nnscaler_cache")


#: Marks a checkpoint (and its optimizer entries) whose parallelized state is in a sharded directory.
SHARDED = "nnscaler_sharded"
#: Marks an optimizer entry saved before the model was planned (it holds no state yet).
UNPLANNED = "nnscaler_unplanned"


class _CaptureThenLaunch:
    """A launcher's `launch`, run after the strategy's capture in the launching process. A class, not a
    closure: spawned processes are handed the pickled Trainer, its strategy and launcher with it."""

    def __init__(self, strategy: Any, launch: Callable) -> None:
        self.strategy, self.launch = strategy, launch

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        self.strategy._capture_before_launch(function, args)
        return self.launch(function, *args, **kwargs)


class NNScalerStrategyMixin:
    """Shared implementation; see `nnscaler_plugins.adapters.lightning.NNScalerStrategy`."""

    strategy_name = "nnscaler"
    _ns = "lightning.pytorch"  # set on each generated class

    def __init__(self, plan: PlanLike = "dp", *, module_attr: Optional[str] = None, example_inputs: Any = None,
                 loss_fn: Optional[Callable] = None, start_method: str = "popen",
                 process_group_backend: Optional[str] = None, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 cache_dir: Optional[str] = None, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 state_dict_type: str = "full", **plan_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        check_plan(plan, "NNScalerStrategy(plan=...)")
        _check_own_keywords(plan_options)
        # the job's one Session: the plan resolved and its options checked once, here
        self.session = session_for(plan, plan_options, "NNScalerStrategy(...)")
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"NNScalerStrategy: state_dict_type={state_dict_type!r}; use 'full' (one .ckpt file of "
                             "whole tensors, written by rank 0) or 'sharded' (a directory, each rank writing its own "
                             "pieces: nns.checkpoint's format)")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"NNScalerStrategy: start_method={start_method!r}; use 'popen', 'spawn', 'fork' or "
                             "'forkserver'")
        self.plan = plan
        self.plan_options = plan_options
        self.state_dict_type = state_dict_type
        self.module_attr = module_attr
        self.example_inputs = example_inputs
        self.loss_fn = loss_fn
        self.cache_dir = cache_dir  # None: chosen at setup (`generated_code_dir`)
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.pmodule: Any = None  # the ParallelModule, once set up
        self._whole_steps = False
        self._replaced_optimizers: dict[int, Any] = {}  # id of a plain optimizer -> its ZeRO rebuild
        self._deferred_restore: Optional[dict] = None  # a checkpoint restored before the model was planned
        self._trainer: Any = None
        self._attr: Optional[str] = None

    # -- namespace access ---------------------------------------------------------------------------
    def _imp(self, suffix: str) -> Any:
        """Import `<namespace>.<suffix>`; "fabric." suffixes go to the matching fabric package."""
        if suffix.startswith("fabric."):
            base = "lightning.fabric" if self._ns == "lightning.pytorch" else "lightning_fabric"
            return importlib.import_module(f"{base}.{suffix[len('fabric.'):]}")
        return importlib.import_module(f"{self._ns}.{suffix}")

    # -- processes ----------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Ranks of one model replica (its tensor-parallel and pipeline devices) read the same batch."""
        if self.pmodule is not None:
            return {"num_replicas": self.pmodule.dp_size, "rank": self.pmodule.dp_rank}
        # Loaders set up before the model (a stage's own loaders, Lightning's tests): the plan's mesh
        # when it is fixed before capture; the model's setup checks the plan kept it (`_setup_model`).
        mesh = self.session.source.mesh_before_capture(self._world_size_to_launch(), self.session.options)
        if mesh is None:
            raise RuntimeError(f"NNScalerStrategy: a loader was set up before the model, and plan "
                               f"{self.session.source.label!r} chooses its data-parallel degree from the "
                               "captured model; give a plan with fixed degrees (a strategy name with its degree "
                               "options, or a plan file), or let the Trainer set the loaders up after the model")
        self._sampler_replicas = mesh.replicas
        return {"num_replicas": mesh.replicas, "rank": self.global_rank // mesh.unit_size}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the weights go into the shards, which exist only after setup

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero = self._imp("utilities.rank_zero").rank_zero_only
        from lightning_utilities.core.rank_zero import (
            rank_zero_only as utils_rank_zero_only,
        )
        rank_zero.rank = utils_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        launchers = self._imp("strategies.launchers")
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = launchers._SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                                 self.num_nodes)
            starts_others = not self.cluster_environment.creates_processes_externally
        else:
            self._launcher = launchers._MultiProcessingLauncher(self, start_method=self._start_method)
            starts_others = True
        if starts_others:  # this process starts the others: capture here first, so a model that cannot be
            # captured is reported once, before any other process exists
            self._launcher.launch = _CaptureThenLaunch(self, self._launcher.launch)

    def _capture_before_launch(self, function: Callable, args: tuple) -> None:
        """`fit` with `example_inputs=` only: the inner module captured on them the way
        `nns.parallelize` will capture it on every rank, so a model that cannot be captured stops the
        job here, once, before any other process exists. Without them nothing of the user's runs
        outside the loop: the ranks capture at the model's first call in their own first step."""
        if getattr(function, "__name__", "") != "_fit_impl" or not args or self.example_inputs is None:
            return
        from nnscaler_plugins.capture.tracing import CaptureError

        try:
            inner = getattr(args[0], self.module_attr or _find_inner_module(args[0]))
            if isinstance(inner, PlannedModel):
                return  # planned already, by an earlier stage on this Trainer
            graph = self.session.capture(inner, self.example_inputs)
        except CaptureError as e:
            if self.session.executor != "captured" and self.session.can_run_eagerly(self._world_size_to_launch()):
                return  # the ranks run the model's own forward (the eager executor) and the plan says why
            if self.session.executor == "captured":
                raise
            raise self.session.with_eager_plans(e) from None
        except Exception:  # noqa: BLE001 - the ranks meet it again and report it as they always did
            return
        del graph
        gc.collect()

    def _world_size_to_launch(self) -> int:
        return max(1, len(self.parallel_devices or ())) * max(1, int(getattr(self, "num_nodes", 1) or 1))

    def on_exception(self, exception: BaseException) -> None:
        """A capture error on this process (rank 0) is the job's report: the ranks this process started
        wait quietly (see `nnscaler_plugins.session.QUIET_RANK_WAIT_S`) and are stopped now."""
        super().on_exception(exception)
        from nnscaler_plugins.capture.tracing import CaptureError

        launcher = getattr(self, "_launcher", None)
        if isinstance(exception, CaptureError) and getattr(launcher, "procs", None):
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))

    def setup_environment(self) -> None:
        super().setup_environment()
        self._imp("fabric.utilities.seed").reset_seed()
        self.set_world_ranks()
        from nnscaler_plugins.plugins import get_plugin_manager

        backend = self._process_group_backend or get_plugin_manager().hook.nnscaler_choose_backend(
            device_type=self.root_device.type)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        self._imp("fabric.utilities.distributed")._init_dist_connection(self.cluster_environment, backend,
                                                                        timeout=self._timeout)

    def model_to_device(self) -> None:
        """Tensors on the meta device (built in `configure_model`) stay there: the plan makes their shards."""
        assert self.model is not None
        from nnscaler_plugins.runtime.materialize import has_meta_tensors

        device = self.root_device
        if not has_meta_tensors(self.model):
            self.model.to(device)
            return
        self.model._apply(lambda t: t if t.is_meta else t.to(device))
        if hasattr(self.model, "_device"):  # what LightningModule.to records for its `device` property
            self.model._device = device

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Any:
        """`configure_model` (and `trainer.init_module()`) build on the meta device, as under FSDP: no
        process makes the whole model; each rank materializes its shards by the model's own
        initialization when the plan is set up (`empty_init=False` builds real tensors)."""
        with (torch.device("meta") if empty_init is not False else contextlib.nullcontext()), \
                self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Any:
        with torch.device("meta"):
            yield

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return self._imp("fabric.utilities.distributed")._sync_ddp_if_available(tensor, group,
                                                                                     reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning enters this on batches that only accumulate gradients. Whole-step plans average
        each step's gradients before they are set aside, so they never skip the reduction."""
        skip = self.pmodule is not None and not getattr(self, "_whole_steps", False)
        with self.pmodule.no_sync() if skip else contextlib.nullcontext():
            yield None

    def teardown(self) -> None:
        """Lightning's teardown (end of fit, validate, test, predict): the watchdog thread watching this
        strategy's module ends too, so no thread outlives the Trainer (the next step that needs it
        starts it again)."""
        super().teardown()
        from nnscaler_plugins.runtime.watchdog import WATCHDOG

        if self.pmodule is not None and WATCHDOG.recorder() is self.pmodule.flight_recorder:
            WATCHDOG.stop()

    # -- the model ----------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        super().setup(trainer)
        # Lightning's norm clipping sees only this rank's shards; value clipping is elementwise and
        # correct on shards as it is.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _setup_model(self, model: Any) -> Any:
        """The submodule to plan is found now; it is planned at its first call, inside the user's own
        step, on what that step passes it (`first_call`), or now when `example_inputs=` are given."""
        attr = self._attr = self.module_attr or _find_inner_module(model)
        inner = getattr(model, attr, None)
        if isinstance(inner, PlannedModel):  # a later stage (validate, test, predict, another fit) on this Trainer
            if self.pmodule is not None and inner.pmodule is self.pmodule:
                return model
            raise RuntimeError(f"NNScalerStrategy: {type(model).__name__}.{attr} was planned by another Trainer's "
                               "strategy; run every stage on that Trainer, or give this one a fresh module (load "
                               "the checkpoint, or unpickle the planned module: it holds the plain model)")
        if not isinstance(inner, torch.nn.Module):
            raise AttributeError(f"NNScalerStrategy(module_attr={attr!r}): {type(model).__name__}.{attr} is not an "
                                 "nn.Module; name the submodule training_step calls")
        if self.example_inputs is not None:
            self._plan(model, attr, inner, self.example_inputs)
        elif not first_call.pending(inner):
            self._materialize_rest(model, without=attr)
            first_call.plan_at_first_call(inner, self._plan_at_first_call)
        return model

    def _plan_at_first_call(self, inner: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Inside the user's step, at its first call of the submodule: planned on exactly what the
        step passes it (less what the forward does not take: the `nnscaler_example_inputs` hook), in
        training mode (the first call may be a validation step's), then the step goes on."""
        from .hookspecs import example_inputs

        model, attr = self.lightning_module, self._attr
        if getattr(model, attr, None) is not inner:
            raise RuntimeError(f"NNScalerStrategy: {type(model).__name__}.{attr} was replaced after the Trainer set "
                               "it up; set the model up before fit/validate/test/predict")
        if args and kwargs:  # one example: positional arguments named by the forward's signature
            bound = inspect.signature(inner.forward).bind(*args, **kwargs)
            batch: Any = dict(bound.arguments)
        elif kwargs:
            batch = dict(kwargs)
        else:
            batch = args[0] if len(args) == 1 else tuple(args)
        with first_call.planning_context(self.root_device):
            example = example_inputs(inner, first_call.ordinary_tensors(batch))
            was_training = inner.training
            inner.train()
            try:
                planned = self._plan(model, attr, inner, example)
            finally:
                inner.train(was_training)
            planned.train(was_training)
        return planned

    def _plan(self, model: Any, attr: str, inner: torch.nn.Module, example: Any) -> PlannedModel:
        """Plan, compile and set up `inner` on `example`; it is replaced by its `PlannedModel`, and
        the optimizers `configure_optimizers` built from the plain parameters now hold this rank's
        pieces (rebuilt as the plan's sharded optimizer under ZeRO); a checkpoint Lightning restored
        before the first call is loaded into them."""
        from .hookspecs import on_parallelized

        from nnscaler_plugins.capture.skeleton import meta_skeleton

        names: dict[int, list[str]] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(fqn)
        skeleton = meta_skeleton(inner)  # what a pickle of the planned model rebuilds (PlannedModel.__reduce__)
        kept = set(inner.state_dict())
        buffers = {k: b.detach().cpu().clone() for k, b in inner.named_buffers() if k not in kept}
        root = getattr(self._trainer, "default_root_dir", None)
        self.pmodule = self.session.parallelize(inner, example, device=self.root_device,
                                                cache_dir=generated_code_dir(self.cache_dir, root), loss_fn=self.loss_fn)
        check_training_state(self.pmodule.plan, "NNScalerStrategy", zero=True)
        given = getattr(self, "_sampler_replicas", None)
        if given is not None and given != self.pmodule.dp_size:
            raise RuntimeError(f"NNScalerStrategy: loaders were split for {given} replicas before the model was "
                               f"set up, and the plan has {self.pmodule.dp_size}; this is a bug to report")
        whole = self.pmodule.plan.pipeline is not None or self.pmodule.plan.num_micro_batches > 1
        self._whole_steps = whole
        planned = PlannedModel(self.pmodule, whole_steps=whole, skeleton=skeleton, buffers=buffers,
                               eval_refusal=self._eval_refusal(skeleton, attr))
        setattr(model, attr, planned)
        self._materialize_rest(model)
        # The replaced module's weights (already on the device) are held only by the reference cycles
        # the capture left; free them now rather than at some later collection (measured on one GPU:
        # 0.47 GiB, GPT-2 small's fp32 weights, still allocated during training otherwise).
        del inner
        gc.collect()
        self._optimizers_to_planned(model, attr, names)
        self._restore_deferred()
        on_parallelized(self.pmodule, self.pmodule.plan, "lightning")
        return planned

    def _optimizers_to_planned(self, model: Any, attr: str, names: Optional[dict[int, list[str]]]) -> None:
        """The optimizers built from the plain parameters (`names`: their ids -> FQNs, None when
        they were built from the planned ones) hold the planned ones; under ZeRO each is rebuilt as
        the plan's sharded optimizer (same class, hyperparameters and groups) and the schedulers
        are pointed at it."""
        from .rebuild_optimizer import point_at_planned, rebuild_sharded

        if not self.optimizers:
            return
        prefix = attr + "."
        own = dict(model.named_parameters())

        def planned(fqn: str) -> Optional[torch.Tensor]:
            return self.pmodule.parameter(fqn[len(prefix):]) if fqn.startswith(prefix) else own.get(fqn)

        for opt in self.optimizers if names is not None else ():
            point_at_planned(opt, names, planned, "NNScalerStrategy")
        plan = self.pmodule.plan
        if not plan.zero or plan.dp <= 1:
            return
        swapped = {id(opt): rebuild_sharded(self.pmodule, opt, "NNScalerStrategy") for opt in self.optimizers}
        self._replaced_optimizers.update(swapped)
        for opt in self.optimizers:  # it steps over nothing from now on (see `optimizer_step`)
            for group in getattr(opt, "_optimizer", opt).param_groups:
                group["params"] = []
        self.optimizers = [swapped[id(opt)] for opt in self.optimizers]  # Lightning's wrappers made again
        for config in self.lr_scheduler_configs:
            old = getattr(config.scheduler, "optimizer", None)
            if id(old) in swapped:
                config.scheduler.optimizer = swapped[id(old)]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Steps the optimizer that stands for `optimizer` now: under ZeRO, the sharded one it was
        rebuilt as when the model was planned. In the step whose closure plans the model the plain
        optimizer steps over nothing (its groups were emptied) and the rebuilt one steps after it."""
        key = id(getattr(optimizer, "_optimizer", optimizer))
        if key in self._replaced_optimizers:
            return super().optimizer_step(self._replaced_optimizers[key], closure, model, **kwargs)
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        rebuilt = self._replaced_optimizers.get(key)
        if rebuilt is not None:  # planned inside this step's closure: its gradients are the rebuilt one's
            rebuilt.step()
        return result

    def _eval_refusal(self, skeleton: Any, attr: str) -> str:
        """Why this plan cannot run the model in evaluation mode ("" when it can): a program captured in
        training mode runs dropout and batch norm as in training, so a model with them is evaluated only
        by its own forward (the eager executor, which follows `eval()`)."""
        if self.pmodule.eager_only or skeleton is None:
            return ""
        found = mode_dependent_modules(skeleton)
        if not found:
            return ""
        return (f"NNScalerStrategy: {attr}.{', '.join(found[:4])} compute differently in evaluation, and this plan "
                "runs a program captured in training mode; validate, test and predict with a plan that runs the "
                "model's own forward (plan='dp' or a ZeRO plan with executor='eager'), or without those modules")

    def _materialize_rest(self, model: Any, without: Optional[str] = None) -> None:
        """What `configure_model` built on the meta device outside the planned submodule (heads, metrics,
        frozen parts) is made whole on every rank, by the same seeded initialization (the seed the
        plan's own initialization agrees on), then moved; `without`: the submodule still to be planned,
        left on the meta device for the plan to make its shards."""
        from nnscaler_plugins.runtime.materialize import has_meta_tensors, materialize_in_place
        from nnscaler_plugins.session import agreed_init_seed

        held = model._modules.pop(without) if without is not None else None
        try:
            if has_meta_tensors(model):
                seed = self.pmodule.init_seed if self.pmodule is not None else None
                if seed is None:
                    seed = agreed_init_seed(None, self.root_device, self._world_size_to_launch())
                materialize_in_place(model, seed)
                self.model_to_device()
        finally:
            if held is not None:
                model._modules[without] = held

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizers from `configure_optimizers`, over the plain parameters until the model
        is planned at its first call (`_optimizers_to_planned` then points them at the planned ones),
        or at once when it is planned already (`example_inputs=`, a later stage)."""
        super().setup_optimizers(trainer)
        if self.pmodule is not None and self._attr is not None:
            inner = getattr(self.lightning_module, self._attr, None)
            if isinstance(inner, PlannedModel) and inner.pmodule is self.pmodule:
                self._optimizers_to_planned(self.lightning_module, self._attr, None)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        from nnscaler_plugins.runtime.grad_clip import clip_grad_norm_
        from nnscaler_plugins.runtime.optimizer import ParallelOptimizer

        inner = getattr(optimizer, "_optimizer", optimizer)
        inner = self._replaced_optimizers.get(id(inner), inner)
        if isinstance(inner, ParallelOptimizer):  # ZeRO: the gradients are its shards
            inner.clip_grad_norm_(float(clip_val))
            return
        clip_grad_norm_(self.pmodule, float(clip_val))

    # -- checkpoints ----------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """An ordinary (whole-tensor) state dict of the LightningModule, loadable without this strategy
        (collective: Lightning calls it on every rank)."""
        lm = self.lightning_module
        if self.pmodule is None:  # not planned yet (no call of the model so far): the plain module's own
            return lm.state_dict()
        prefix = self._attr + "."
        out = {k: v for k, v in lm.state_dict().items() if not k.startswith(prefix)}
        if self.state_dict_type == "sharded":
            return out  # the parallelized weights go to `save_checkpoint` as each rank's pieces
        # rank 0 writes the checkpoint (`save_checkpoint`): the others hold no whole tensor of it
        out.update({prefix + k: v for k, v in self.pmodule.full_state_dict(rank0_only=True).items()})
        return out

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        prefix = self._attr + "."
        state = checkpoint["state_dict"]
        if self.pmodule is None:  # the plain module takes the weights; planning carries them into the shards
            self._defer_restore(checkpoint)
            if not checkpoint.get(SHARDED):
                self.lightning_module.load_state_dict(state, strict=strict)
                return
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
            result = self.lightning_module.load_state_dict(state, strict=False)
            if strict and result.unexpected_keys:
                raise KeyError(f"checkpoint has keys the LightningModule lacks: {result.unexpected_keys[:8]}")
            return
        if not checkpoint.get(SHARDED):  # a sharded checkpoint's weights are in the shards already
            self.pmodule.load_full_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        rest = {k: v for k, v in state.items() if not k.startswith(prefix)}
        result = self.lightning_module.load_state_dict(rest, strict=False)
        if strict and result.unexpected_keys:
            raise KeyError(f"checkpoint has keys the LightningModule lacks: {result.unexpected_keys[:8]}")

    def optimizer_state(self, optimizer: Any) -> dict:
        """The optimizer's state as whole tensors under parameter names, complete in rank 0's
        checkpoint, so a resume reshards it to any plan and process count (see `adapters.resume`).
        Collective: Lightning calls it on every rank."""
        from .resume import save_state

        if self.pmodule is None:  # a checkpoint before the model's first call: nothing was stepped yet
            if getattr(optimizer, "_optimizer", optimizer).state:
                raise RuntimeError("NNScalerStrategy: the optimizer holds state and the model is not planned yet "
                                   "(it is planned at its first call); save checkpoints after the first step")
            return {UNPLANNED: True}
        if self.state_dict_type == "sharded":
            return {SHARDED: True}  # the state goes to `save_checkpoint` as each rank's pieces
        return save_state(self.pmodule, optimizer)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        from .resume import load_state

        states = checkpoint.get("optimizer_states")
        if self.pmodule is None:  # loaded into the planned optimizers at the model's first call
            self._defer_restore(checkpoint)
            return
        if not states or checkpoint.get(SHARDED) or any(UNPLANNED in s for s in states if isinstance(s, dict)):
            return  # a sharded checkpoint's state was read into the shards by `load_checkpoint`
        for optimizer, saved in zip(self.optimizers, states):
            load_state(self.pmodule, optimizer, saved)  # checked by load_checkpoint, before any restore

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """'full': rank 0 writes one file (Lightning's way). 'sharded': `filepath` becomes a
        directory in `nns.checkpoint`'s format, each rank writing its own pieces of the weights and
        the optimizer state (no whole tensor anywhere) and the rest of Lightning's checkpoint as its
        extra; it loads under any plan and process count, atomically replaced (collective)."""
        if self.state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        import nnscaler_plugins as nns

        if storage_options is not None:
            raise TypeError("NNScalerStrategy(state_dict_type='sharded') writes with nns.checkpoint and takes no "
                            "storage_options")
        rest = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        rest["optimizer_states"] = [{SHARDED: True} for _ in checkpoint.get("optimizer_states") or []]
        nns.checkpoint.save(str(filepath), self.pmodule, self._sharded_optimizer(), lightning=rest)

    def _sharded_optimizer(self) -> Any:
        """The one optimizer a sharded checkpoint holds (None outside fit)."""
        opts = list(self.optimizers or [])
        if len(opts) > 1:
            raise ValueError(f"NNScalerStrategy(state_dict_type='sharded') holds one optimizer's state; "
                             f"configure_optimizers gives {len(opts)}: use state_dict_type='full'")
        return opts[0] if opts else None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        if os.path.isdir(checkpoint_path):
            return self._load_sharded(str(checkpoint_path))
        checkpoint = self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._check_resumable(checkpoint)
        return checkpoint

    def _load_sharded(self, path: str) -> dict:
        """A directory `save_checkpoint` wrote in 'sharded' mode (whichever mode this run uses): the
        weights and the optimizer state go straight into this plan's shards (`nns.checkpoint.load`
        checks names and shapes on every rank before it changes anything); Lightning gets the rest."""
        import nnscaler_plugins as nns
        from nnscaler_plugins.checkpoint.format import METADATA, read_extra, read_metadata

        if not os.path.isfile(os.path.join(path, METADATA)):
            raise IsADirectoryError(f"NNScalerStrategy: {path} is a directory but not a sharded checkpoint "
                                    f"({METADATA} is missing); full checkpoints are single .ckpt files")
        if self.pmodule is None:  # read into the shards when the model is planned, at its first call
            directory, meta = read_metadata(path)
            checkpoint = dict(read_extra(directory, meta).get("lightning") or {})
            checkpoint[SHARDED] = True
            self._defer_restore(checkpoint, path)
            return checkpoint
        fitting = self._trainer is not None and self._trainer.state.fn == "fit"
        extra = nns.checkpoint.load(path, self.pmodule, self._sharded_optimizer() if fitting else None)
        checkpoint = dict(extra.get("lightning") or {})
        checkpoint[SHARDED] = True
        return checkpoint

    def _defer_restore(self, checkpoint: dict, path: Optional[str] = None) -> None:
        """A checkpoint Lightning restores before the model's first call: its weights are loaded into
        the plain module now (a sharded one's, and every optimizer state, when it is planned)."""
        if self._deferred_restore is None or self._deferred_restore["checkpoint"] is not checkpoint:
            self._deferred_restore = {"checkpoint": checkpoint, "path": path}
        elif path is not None:
            self._deferred_restore["path"] = path

    def _restore_deferred(self) -> None:
        """Right after planning, inside the first step: the deferred checkpoint checked against the plan
        and loaded into the shards and the optimizers (`_defer_restore`)."""
        deferred, self._deferred_restore = self._deferred_restore, None
        if deferred is None:
            return
        checkpoint, path = deferred["checkpoint"], deferred["path"]
        if path is not None:
            self._load_sharded(path)
            return
        self._check_resumable(checkpoint)
        if self._trainer is not None and self._trainer.state.fn == "fit":
            self.load_optimizer_state_dict(checkpoint)

    def _check_resumable(self, checkpoint: dict) -> None:
        """Everything that could stop a restore half way, checked on every rank and agreed on before
        Lightning restores anything: the weights' names and shapes, and each optimizer's state
        (whole state reshards to any plan; per-rank state fits only the plan that wrote it)."""
        from nnscaler_plugins.checkpoint.model_state import expected_model_tensors

        from . import resume

        if self.pmodule is None:
            return
        found = []
        prefix = self._attr + "."
        state = checkpoint.get("state_dict") or {}
        have = {k[len(prefix):]: tuple(v.shape) for k, v in state.items()
                if k.startswith(prefix) and isinstance(v, torch.Tensor)}
        for name, shape in expected_model_tensors(self.pmodule).items():
            if name not in have:
                found.append(f"the checkpoint lacks weight {prefix + name}")
            elif have[name] != shape:
                found.append(f"weight {prefix + name} has shape {list(have[name])} in the checkpoint, {list(shape)} here")
        saved_states = checkpoint.get("optimizer_states") or []
        if self._trainer is not None and self._trainer.state.fn == "fit" and saved_states:
            if len(saved_states) != len(self.optimizers):
                found.append(f"the checkpoint has {len(saved_states)} optimizer(s), configure_optimizers gives "
                             f"{len(self.optimizers)}")
            for i, (opt, saved) in enumerate(zip(self.optimizers, saved_states)):
                found += resume.problems(self.pmodule, opt, saved, i)
        found = resume.agree(found[:8])
        saved_plan = next((s.get(resume.PLAN) for s in saved_states if isinstance(s, dict)), None)
        resume.refuse("NNScalerStrategy", found, saved_plan, self.pmodule)
        resume.note_resharding(saved_plan, self.pmodule, "NNScalerStrategy")

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("nnscaler", cls, description="nnscaler-plugins plans (dp, tp, pipelines, auto)",
                                   override=True)
        strategy_registry.register("nnscaler_spawn", cls, description="nnscaler-plugins plans, spawned processes",
                                   start_method="spawn", override=True)


def _find_inner_module(model: torch.nn.Module) -> str:
    names = [n for n, m in model.named_children() if any(p.requires_grad for p in m.parameters())]
    if len(names) != 1:
        raise AttributeError(f"NNScalerStrategy parallelizes one submodule of the LightningModule (the model "
                             f"training_step calls); {type(model).__name__} has {len(names)} with trainable "
                             f"parameters ({', '.join(names) or 'none'}): pass module_attr='<name>'")
    return names[0]
