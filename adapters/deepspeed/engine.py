"""The engine a DeepSpeed script drives: forward, backward, step, with DeepSpeed's accumulation rules.

The model is parallelized under the plan the config's "nnscaler" section names (data parallel by
default) as soon as example inputs are known: at `initialize` when it was given `example_inputs=`
or `training_data=` (the loader's first micro-batch), otherwise at the first forward (or
`train_batch`). Until then every method works on the model itself: `parameters()`, checkpoints
saved and loaded (the loaded weights go into the model at once, the optimizer state once it is
parallelized). Once parallelized, the model's parameters share storage with this rank's pieces
where those are whole, so tensors a script took from the model before stay the trained ones.

The optimizer the script holds stays the same object: it is made over the model's own parameters
and, when the model is parallelized, its param groups are pointed at this rank's shards (nothing
has stepped yet, so there is no state to move). Schedulers made on it keep working.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import nnscaler_plugins as nns
from nnscaler_plugins.runtime.grad_clip import clip_by_norm_, grad_norm
from nnscaler_plugins.outputs import extract_loss, require_scalar_loss
from nnscaler_plugins.runtime.zero import all_gather_chunks
from nnscaler_plugins.session import Session

from . import checkpoint as ckpt
from .checkpoint import universal
from .config import DeepSpeedConfigError, Settings
from .held_params import HeldParameters, register_in_place_of
from .pipeline_module import PipelineModule, pipeline_call
from .zero_optimizer import ZeroOptimizer

log = logging.getLogger("nnscaler_plugins.deepspeed")


def _concat(batches: list) -> Any:
    """Micro-batches joined along the batch dim (what a pipeline plan's train_step cuts again)."""
    if len(batches) == 1:
        return batches[0]
    flat = [pytree.tree_flatten(b) for b in batches]
    spec = flat[0][1]
    leaves = []
    for parts in zip(*(f[0] for f in flat)):
        first = parts[0]
        leaves.append(torch.cat(parts) if isinstance(first, torch.Tensor) and first.ndim > 0 else first)
    return pytree.tree_unflatten(leaves, spec)


class DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed's engine surface over a ParallelModule. Build it with `initialize`."""

    def __init__(self, model: torch.nn.Module, settings: Settings, config: dict, *, session: Session,
                 optimizer: Any, lr_scheduler: Any, rank: int, world_size: int, unit_size: int, dp_size: int,
                 cache_dir: str = ".nnscaler_cache"):
        super().__init__()
        # Kept out of nn.Module's registry: `parameters()` must be the weights that train, which
        # are the model's until it is parallelized and the ParallelModule's after.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_pmodule", None)
        self._settings = settings
        self._session = session  # the plan, resolved once at initialize; it captures, plans and compiles
        self._config = config
        self._cache_dir = cache_dir
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader: Any = None
        self.global_rank = rank
        self.world_size = world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # set by the launcher (torchrun, deepspeed)
        self.mp_world_size = unit_size
        self.dp_world_size = dp_size
        self.dp_rank = rank // unit_size
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.sparse_tensor_module_names: set = set()  # DeepSpeed's sparse-gradient modules: none here
        # zero_optimization.enable_sanity_checks: writing into gathered parameters unannounced raises
        self.sanity_checks = bool((config.get("zero_optimization") or {}).get("enable_sanity_checks", False))
        self._boundary_override: Optional[bool] = None
        self._in_no_sync = False
        self._grad_norm: Optional[float] = None
        self._step_applied = False
        self._pending_load: Optional[tuple[str, bool, bool]] = None  # a checkpoint to load once parallelized
        self._pending_state: Optional[dict] = None  # whole optimizer state by name, to load once parallelized
        self._data_iter: Optional[Iterator] = None
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        # A tied parameter goes by its last name (the one the plan updates; its other names follow).
        self._model_param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        # the objects behind those ids: while an id is a key its object lives, so no other tensor
        # can take the id and be taken for this engine's parameter (two engines, one model freed)
        self._param_objects = {id(p): p for p in model.parameters()}
        self._tied = {n: self._model_param_names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                      if self._model_param_names[id(p)] != n}
        from .zero import take_from_engine, whole_shape

        take_from_engine(model)  # (a model another engine trains: its current weights)
        self._model_params = dict(model.named_parameters())
        self._whole_shapes = {n: whole_shape(p) for n, p in self._model_params.items()}
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if settings.precision != "fp32":  # DeepSpeed's bf16/fp16 engines hold the model in that dtype
            from nnscaler_plugins.runtime.precision import compute_dtype

            model.to(compute_dtype(settings.precision))
        from .zero import register_engine

        register_engine(self)
        # A model built on the meta device (zero.Init) is initialized per piece when parallelized, from
        # one seed every rank agrees on here, so that saving it before then gives the same weights.
        self._init_seed: Optional[int] = _agreed_seed() if _has_meta(model) else None
        # ZeRO-3: the parameters hold no values from here on, as DeepSpeed's (see held_params.py)
        self._held: Optional[HeldParameters] = None
        if settings.zero_stage >= 3:
            self._held = HeldParameters(model, self._model_params, self._whole_shapes, self._model_param_names)

    def _whole(self) -> Any:
        """Before the model is parallelized: a context in which its parameters are whole (under
        ZeRO-3 they are kept aside otherwise); nothing to do after."""
        return self._held.whole() if self._held is not None and self._pmodule is None else contextlib.nullcontext()

    def _materialize(self) -> None:
        """The whole model in this process, initialized as parallelizing it would (only for state
        asked of a meta model before it is parallelized). Call it inside `_whole()`."""
        if self._pmodule is None and _has_meta(self._model):
            nns.init_weights(self._model, self._init_seed)

    # -- the model's own parameters (zero.GatheredParameters) ---------------------------------------
    def name_of(self, param: torch.Tensor) -> Optional[str]:
        """The model's name of `param`: one of the model's parameters, or this rank's piece of one."""
        name = self._model_param_names.get(id(param)) if self._param_objects.get(id(param)) is param else None
        if name is None and self._pmodule is not None:
            name = self.__dict__.get("_piece_names", {}).get(id(param))
            if name is not None and self._pmodule.parameter(name) is not param:
                name = None  # another tensor at the address of a piece this engine no longer holds
        return name

    def _piece_of(self, param: torch.Tensor) -> tuple[str, Optional[torch.Tensor]]:
        name = self.name_of(param)
        return name, (self._pmodule.parameter(name) if self._pmodule is not None else None)

    def full_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole, reduced gradient of a parameter (deepspeed.utils.safe_get_full_grad): where this
        rank holds a piece of it (a ZeRO-2 gradient chunk, a ZeRO-3 chunk, a tensor-parallel piece)
        the pieces are gathered, so every rank calls it, as in DeepSpeed. None before a backward."""
        name, local = self._piece_of(param)
        if local is None:
            return self._model_params[name].grad
        pm = self._pmodule
        shard = pm.zero_shards.get(name)
        reducer = pm.grad_reducer
        chunk = None
        if reducer is not None and id(local) in reducer.shard_grads:  # ZeRO-2: this rank's chunk
            chunk = reducer.shard_grads[id(local)]
        elif pm.zero3 is not None and shard is not None and tuple(local.shape) != tuple(shard.shape):
            chunk = local.grad  # ZeRO-3: the chunk parameter's gradient
            if chunk is None:
                return None
        if chunk is not None:
            piece = torch.empty(shard.numel, dtype=chunk.dtype, device=chunk.device)
            all_gather_chunks([shard], [chunk.reshape(-1)], [piece])
            piece = piece.view(shard.shape)
        else:
            piece = local.grad
            if piece is None:
                return None
        if tuple(piece.shape) != tuple(self._whole_shapes[name]):  # a tensor-parallel piece
            piece = pm.whole_tensor(self._shard_key(name), piece, piece.dtype)
        return piece

    def _shard_key(self, name: str) -> str:
        """The key (into the program's shards) of this device's piece of parameter `name`."""
        for key in self._pmodule.held_keys:
            s = self._pmodule.program.shards[key]
            if s.kind == "param" and s.fqn == name:
                return key
        raise KeyError(name)

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Make `value` (the whole, reduced gradient) the gradient the next step uses for `param`
        (deepspeed.utils.safe_set_full_grad): each rank keeps its piece of it (its ZeRO-2 or ZeRO-3
        chunk, its tensor-parallel piece)."""
        name, local = self._piece_of(param)
        if local is None:
            target = self._model_params[name]
            target.grad = value.detach().to(target.dtype).clone()
            return
        scale = self.optimizer.loss_scale if isinstance(self.optimizer, ZeroOptimizer) else 1.0
        value = value.detach().reshape(self._whole_shapes[name]) * scale  # held times the fp16 loss scale
        pm = self._pmodule
        shard = pm.zero_shards.get(name)
        if shard is not None and tuple(shard.shape) != tuple(value.shape):  # a tensor-parallel piece
            value = pm.program.shards[self._shard_key(name)].layout.slice_full(value, pm.unit_device)
        if pm.zero3 is not None and shard is not None and tuple(local.shape) != tuple(shard.shape):
            mine = shard.owned(value.reshape(-1)).reshape(local.shape)  # ZeRO-3: this rank's chunk
            local.grad = mine.to(local.dtype).clone()
            return
        value = value.reshape(local.shape)
        reducer = self._pmodule.grad_reducer
        if reducer is not None and id(local) in reducer.shard_grads:
            shard = self._pmodule.zero_shards[name]
            chunk = reducer.shard_grads[id(local)]
            mine = shard.owned(value.reshape(-1))
            chunk.zero_()
            chunk.reshape(-1)[:mine.numel()].copy_(mine.to(chunk.dtype))
        elif local.grad is not None:
            local.grad.copy_(value.to(local.grad.dtype))
        else:
            local.grad = value.to(local.dtype).clone()
        self._share_grads()

    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor:
        """The whole fp32 value of a parameter: the master weight under bf16/fp16 (collective)."""
        name, _ = self._piece_of(param)
        if self._pmodule is None:
            with self._whole():
                self._materialize()
                return dict(self._model.named_parameters())[name].detach().float().clone()
        if isinstance(self.optimizer, ZeroOptimizer):
            master = self.optimizer.inner.full_state_dict(only=[name])["state"].get(name, {}).get("master_param")
            if master is not None:
                return master.float()
        return self._pmodule.full_state_dict(only=[name])[name].float()

    def gather_whole(self, params: list) -> list[Callable[[], None]]:
        """Make each of these parameters (the model's, or this rank's pieces) the whole, current
        tensor (zero.GatheredParameters; collective once parallelized: every rank passes the same
        parameters). Returns what puts each back as it was."""
        if self._pmodule is None:
            with self._whole():
                self._materialize()  # a zero.Init model before it is parallelized: whole, as it will train
            if self._held is None:
                return []
            restore = []
            for p in params:  # ZeRO-3: the kept values, written in place
                if self._held.is_kept(p):  # the model's own meta-era object, whole now
                    continue
                p.data = self._held.value(self.name_of(p))
                restore.append(lambda p=p: setattr(p, "data", torch.empty(0, dtype=p.dtype, device=p.device)))
            return restore
        names = sorted({self.name_of(p) for p in params})
        whole = self._pmodule.full_state_dict(only=names)
        restore = []
        with torch.no_grad():
            for p in params:
                if p.is_meta:
                    raise RuntimeError(f"GatheredParameters: {self.name_of(p)} is a parameter object of the model "
                                       "built under zero.Init from before it was parallelized, when the model got "
                                       "real parameters in place of its meta ones; take it from the model again "
                                       "(engine.module.named_parameters())")
                value = whole.get(self.name_of(p))
                if value is None:  # a parameter the forward never reads: the model's own, whole
                    continue
                if p.shape == value.shape:
                    if p.data_ptr() != value.data_ptr():
                        p.data.copy_(value.to(p.dtype))  # a whole copy (stale if not shared): now current
                    continue
                held = p.data
                p.data = value.to(device=held.device, dtype=p.dtype)
                restore.append(lambda p=p, held=held: setattr(p, "data", held))
        return restore

    def whole_values(self, params: list) -> dict[str, torch.Tensor]:
        """These parameters' values by name, as they are now (inside GatheredParameters: whole)."""
        return {self.name_of(p): p.detach().clone() for p in params}

    def apply_model_parameters(self, values: dict[str, torch.Tensor]) -> None:
        """Train on these whole values from now on (every rank passes the same ones)."""
        if self._pmodule is None:  # the model's own tensors were written in place
            return
        whole = self._pmodule.full_state_dict()
        whole.update(values)
        self._pmodule.load_full_state_dict(whole)

    # -- the module ---------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The model given to initialize, as DeepSpeed's `engine.module` (its attributes, config,
        `save_pretrained`, its parameters under their own names). Once parallelized, a parameter
        whole on this rank shares storage with the piece that trains; the others hold no values and
        carry DeepSpeed's ZeRO-3 marks (zero.GatheredParameters gives them whole). Run it through
        the engine (`engine(batch)`): the model's own forward has only those whole parameters."""
        return self._model

    @property
    def parallel_module(self) -> Optional[Any]:
        """This rank's ParallelModule (its plan, its pieces), None until the model is parallelized."""
        return self._pmodule

    def parallelize(self, example_inputs: Any) -> None:
        """Parallelize the model now, on these example inputs (what one forward takes: a dict is
        keyword arguments, a tuple positional ones, a tensor the single one). `initialize` calls it
        when it was given example_inputs or training_data."""
        if self._pmodule is None:
            self._build(example_inputs)

    def _build(self, example_inputs: Any, micro_batches: int = 1) -> None:
        session = self._session
        if micro_batches > 1:
            session.options["micro_batches"] = micro_batches
        with self._whole():
            pm = session.parallelize(self._model, example_inputs, cache_dir=self._cache_dir, init_seed=self._init_seed)
            acc = self.gradient_accumulation_steps()
            if pm.plan.pipeline is not None and micro_batches == 1 and acc > 1:
                # a pipeline's micro-batches are the accumulation steps: its example is acc micro-batches
                session.options["micro_batches"] = acc
                pm = session.parallelize(self._model, _concat([example_inputs] * acc), cache_dir=self._cache_dir,
                                         init_seed=self._init_seed)
            planned = self._planned_names(pm)
            # a parameter the forward never reads is in no piece: the model keeps its values (whole here)
            unread = {n: p.data for n, p in self._model_params.items()
                      if n not in planned and not p.is_meta and p.numel() > 0}
        self._held = None  # the pieces hold the values now
        object.__setattr__(self, "_pmodule", pm)
        if pm.dp_size != self.dp_world_size:
            raise DeepSpeedConfigError(f"the plan has data-parallel size {pm.dp_size}, the batch sizes were resolved for "
                                       f"{self.dp_world_size}; give nnscaler.dp explicitly")
        pm.train(self._model.training)
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.adopt(pm, self._model_param_names, self._settings.loss_scale)
        elif self.optimizer is not None:
            self._rebind_optimizer()
        if self._pending_load is not None:
            path, with_optimizer, strict = self._pending_load
            self._pending_load = None
            ckpt.load_parallel(path, pm, self._stepping_optimizer() if with_optimizer else None, strict)
        if self._pending_state is not None:  # a universal checkpoint's optimizer state, whole, by name
            self._stepping_optimizer().load_full_state_dict({"state": self._pending_state})
            self._pending_state = None
        self._share_storage(planned, unread)
        self._trainable = {n: p.requires_grad for n, p in self._model_params.items()}

    def _share_storage(self, planned: set, unread: dict) -> None:
        """The model's parameters become views of this rank's pieces where a piece is the whole
        tensor, so the model a script still holds trains along (and its tensors get gradients).
        The others (ZeRO-3 chunks, tensor-parallel pieces, another stage's, and every parameter of a
        model built under zero.Init) hold no values from now on, as DeepSpeed's partitioned
        parameters: they and the pieces carry the ZeRO-3 marks, and zero.GatheredParameters gives
        them whole."""
        from .zero import mark_partitioned

        pairs = []
        for name, p in self._model_params.items():
            local = self._pmodule.parameter(name)
            shape = self._whole_shapes[name]
            if p.is_meta:  # built under zero.Init: a real tensor from now on (a meta one cannot take values)
                p = self._replace_meta(name, p)
            if name not in planned:  # the forward never reads it: no rank holds a piece, the model keeps it whole
                if name in unread:
                    p.data = unread[name]
                    for k in [k for k in vars(p) if k.startswith("ds_")]:
                        delattr(p, k)
                continue
            if local is not None and local.shape == shape and local.dtype == p.dtype:
                p.data = local.data
                for k in [k for k in vars(p) if k.startswith("ds_")]:  # whole here: no ZeRO-3 marks
                    delattr(p, k)
                pairs.append((p, local))
                continue
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            mark_partitioned(p, shape)
            if local is not None and local.shape != shape:
                mark_partitioned(local, shape)
        self._shared = pairs
        self._piece_names = {id(self._pmodule.parameter(n)): n for n in self._model_params
                             if self._pmodule.parameter(n) is not None}

    @staticmethod
    def _planned_names(pm: Any) -> set:
        """Names of the parameters the plan holds (on some rank); one the forward never reads is not
        among them."""
        names = set()
        for shard in pm.program.shards.values():
            names.add(shard.fqn)
            names.update(shard.aliases)
        return names

    def _replace_meta(self, name: str, meta: torch.nn.Parameter) -> torch.nn.Parameter:
        """A real, empty Parameter (with `meta`'s attributes) in place of a meta one, wherever the
        model registers it; the engine knows both objects by the name."""
        new = torch.nn.Parameter(torch.empty(0, dtype=meta.dtype), requires_grad=meta.requires_grad)
        for k, v in vars(meta).items():
            setattr(new, k, v)
        register_in_place_of(self._model, meta, new)
        self._model_params[name] = new
        self._model_param_names.pop(id(meta), None)
        self._param_objects.pop(id(meta), None)
        self._model_param_names[id(new)] = name
        self._param_objects[id(new)] = new
        return new

    def _check_trainable(self) -> None:
        """Which parameters train is fixed when the model is parallelized (its program computes their
        gradients); DeepSpeed lets a script flip requires_grad between steps. Refused by name rather
        than training parameters the script froze."""
        changed = [n for n, p in self._model_params.items() if p.requires_grad != self._trainable[n]]
        if changed:
            raise RuntimeError(f"requires_grad of {changed[:4]} changed after the model was parallelized; this engine "
                               "fixes the trainable parameters then: set requires_grad before initialize (or before "
                               "the first forward)")

    def _share_grads(self) -> None:
        for p, local in getattr(self, "_shared", ()):
            p.grad = local.grad

    def _stepping_optimizer(self) -> Any:
        """The optimizer whose state is saved: the plan's one under the ZeRO wrapper."""
        return self.optimizer.inner if isinstance(self.optimizer, ZeroOptimizer) else self.optimizer

    def _rebind_optimizer(self) -> None:
        """Point the optimizer's param groups at this rank's shards of the same parameters."""
        opt = self.optimizer
        if any(len(st) for st in opt.state.values()):
            raise RuntimeError("the optimizer has state before the model was parallelized (it stepped on the original "
                               "parameters); create it fresh, or load a checkpoint through engine.load_checkpoint")
        for group in opt.param_groups:
            mine = []
            for p in group["params"]:
                name = self._model_param_names.get(id(p))
                if name is None:
                    raise DeepSpeedConfigError("the optimizer holds a tensor that is not a parameter of the model; "
                                               "build it over model.parameters() (or param groups of them)")
                local = self._pmodule.parameter(name)  # None: another pipeline stage's
                if local is not None and all(q is not local for q in mine):
                    mine.append(local)
            group["params"] = mine
        opt.state.clear()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if self._pmodule is None:
            if args and kwargs:
                raise TypeError("the first forward takes either positional or keyword inputs to parallelize the model "
                                "on, not both")
            # The project's convention for example inputs: a dict is keyword arguments, a tensor the
            # single argument, a tuple the positional arguments.
            if kwargs:
                example = kwargs
            elif len(args) == 1 and isinstance(args[0], (torch.Tensor, dict)):
                example = args[0]
            else:
                example = tuple(args)
            self._build(example)
        else:
            self._check_trainable()
        if self._pmodule.plan.pipeline is not None:
            raise RuntimeError("the config's nnscaler plan is a pipeline: it runs whole steps, so call "
                               "engine.train_batch(data_iter) instead of engine(...), backward and step "
                               "(DeepSpeed's PipelineEngine has the same rule)")
        if self.training and torch.is_grad_enabled():  # the script back-propagates this loss itself
            from ..loss_weight import weighed_output

            out = weighed_output(self._pmodule, args, kwargs, lambda: self._pmodule(*args, **kwargs))
        else:
            out = self._pmodule(*args, **kwargs)
        if self._settings.precision != "fp32":
            out = self._in_model_dtypes(out)
        self._times["forward"] += time.perf_counter() - t0
        return out

    def _in_model_dtypes(self, out: Any) -> Any:
        """Outputs in the dtypes the model itself gives them in bf16/fp16, as DeepSpeed's half-precision
        engine (no autocast) returns them: the plan computes under autocast, which keeps some ops
        (losses, softmax) in fp32; the captured graph of the converted model has the model's dtypes."""
        graph = self._pmodule.graph
        wanted = [graph.meta(v).dtype if v is not None else None for v in graph.outputs]
        leaves, spec = pytree.tree_flatten(out)
        if len(leaves) != len(wanted):
            return out
        leaves = [t.to(d) if isinstance(t, torch.Tensor) and d is not None and t.is_floating_point()
                  and t.dtype != d else t for t, d in zip(leaves, wanted)]
        return pytree.tree_unflatten(leaves, spec)

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        super().train(mode)
        self._model.train(mode)
        if self._pmodule is not None:
            self._pmodule.train(mode)
        return self

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters, named as in DeepSpeed's engine (which holds the model as its
        submodule `module`): "module.<name>". Where this rank holds a parameter whole they share
        storage with the piece that trains (and get its gradients); the others hold no values and
        carry DeepSpeed's ZeRO-3 marks."""
        inner = f"{prefix}.module" if prefix else "module"
        yield from self._model.named_parameters(inner, recurse, remove_duplicate)

    def compile(self, backend: Any = None, compile_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        """DeepSpeed's engine.compile(): the model runs under torch.compile. Here that is each rank's
        generated program, compiled by regions between its collectives (the plan's compile knob):
        at once when the model is parallelized already, else when it is. `backend`: a torch.compile
        backend name (DeepSpeed's default, the accelerator's, is inductor); `compile_kwargs` and
        DeepSpeed's schedule arguments tune compilers this engine does not run, and are refused
        when given, so nothing asked for is silently dropped."""
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"engine.compile(backend={backend!r}): pass a torch.compile backend name such as "
                            "'inductor'; the per-rank program is compiled by regions, not by a custom backend")
        extra = {k: v for k, v in {**(compile_kwargs or {}), **kwargs}.items()
                 if v not in (None, False) and k != "compiled_autograd_enabled"}
        if extra:
            raise TypeError(f"engine.compile(): {sorted(extra)} are not supported here (the per-rank program is "
                            "compiled by regions with the plan's compile_backend)")
        if self._pmodule is not None:
            self._pmodule.compile(backend=backend)
        else:
            self._settings.plan_options["compile"] = True
            if backend is not None:
                self._settings.plan_options["compile_backend"] = backend
        self._compile_requested = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_compile_requested", False) or (
            self._pmodule is not None and self._pmodule.artifact.compile_backend is not None)

    def empty_partition_cache(self) -> None:
        """DeepSpeed frees ZeRO-3's gathered parameters here; this engine gathers them per use, so
        there is nothing held to free."""

    # -- accumulation -------------------------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self._settings.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._settings.micro_batch_size

    def train_batch_size(self) -> int:
        return self._settings.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self._settings.managed_gradient_accumulation:
            return True
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller say where the boundary is (accelerate does), instead of counting micro-steps."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for the backwards inside (DeepSpeed refuses it with ZeRO 2 and 3,
        whose gradients are partitioned; so does this engine, to run the same scripts the same way)."""
        assert not self.zero_optimization_stage() >= 2, (  # DeepSpeed asserts these; so does this engine
            f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
            f"{self.zero_optimization_stage()}")
        assert not self._in_no_sync, "no_sync context manager reentry is unsupported"
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss / gradient_accumulation_steps (unless scale_wrt_gas=False) backward; gradients are
        reduced across data-parallel ranks only at the accumulation boundary. Returns the scaled loss."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use backward"
        if self._pmodule is None:
            raise RuntimeError("engine.backward before any forward: run engine(batch) first")
        t0 = time.perf_counter()
        acc = self.gradient_accumulation_steps()
        if scale_wrt_gas and acc > 1:
            loss = loss / acc
        sync = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        scale = self.optimizer.loss_scale if isinstance(self.optimizer, ZeroOptimizer) else 1.0
        with contextlib.nullcontext() if sync else self._pmodule.no_sync():
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self._share_grads()
        self._times["backward"] += time.perf_counter() - t0
        return loss

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At the boundary: clip, step the optimizer and the scheduler, zero the gradients, count
        the step. Off the boundary it only counts the micro-step."""
        assert not self._in_no_sync, "It is illegal to call Engine.step() inside no_sync context manager"
        assert self.optimizer is not None, "must provide optimizer during init in order to use step"
        t0 = time.perf_counter()
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - t0

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        if self._pmodule is None:
            raise RuntimeError("engine.step before any forward: run engine(batch) and engine.backward(loss) first")
        clip = self._settings.gradient_clipping
        if isinstance(self.optimizer, ZeroOptimizer):  # the plan's optimizer unscales fp16 gradients first
            self._grad_norm = float(self.optimizer.clip_grad_norm_(clip if clip > 0 else float("inf")))
        else:
            self._grad_norm = float(grad_norm(self._pmodule))  # DeepSpeed reports a float, clips by its rule
            if clip > 0:
                clip_by_norm_(self._pmodule, clip, self._grad_norm)
        # bf16's check_grad_overflow: inf/nan gradients skip the step (the norm is every rank's)
        overflow = self._settings.skip_nonfinite_steps and not math.isfinite(self._grad_norm)
        if self.optimizer is not None:
            if not overflow:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._share_grads()
        skipped = overflow or (isinstance(self.optimizer, ZeroOptimizer) and self.optimizer.last_step_skipped)
        if skipped:  # fp16 or checked bf16 overflow: DeepSpeed skips the step and holds the schedule
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self._step_applied = not skipped
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._report()

    def _report(self) -> None:
        every = self._settings.steps_per_print
        if not every or self.global_steps % every or self.global_rank != 0:
            return
        if not log.hasHandlers():  # DeepSpeed's progress lines show without logging set up; so do these
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        log.info("step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps, self.skipped_steps, self.get_lr(),
                 self.get_mom())
        if self._settings.wall_clock_breakdown:
            log.info("time (ms) | forward: %.2f | backward: %.2f | step: %.2f",
                     *(1000 * self._times[k] for k in ("forward", "backward", "step")))
            self._times = dict.fromkeys(self._times, 0.0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self._share_grads()

    # -- pipelines ----------------------------------------------------------------------------------
    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches from `data_iter` (or
        the training_data given to initialize). Returns the mean loss over the micro-batches and the
        data-parallel ranks, as DeepSpeed's PipelineEngine does. Each micro-batch is what the model's
        forward takes, and the model computes its loss."""
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch needs data_iter= or training_data= given to initialize")
            if self._data_iter is None:
                self._data_iter = _repeat(self.training_dataloader)
            data_iter = self._data_iter
        acc = self.gradient_accumulation_steps()
        micro = [self._micro_batch(next(data_iter)) for _ in range(acc)]
        if self._pmodule is None:
            if isinstance(self._model, PipelineModule) and self._model.num_stages == 1:
                # one stage: DeepSpeed's loop of forward, backward and step per micro-batch, so that
                # eval_batch's plain forwards run on the same plan
                self._build(micro[0])
            else:
                self._build(_concat(micro), micro_batches=acc)
        pm = self._pmodule
        if pm.plan.num_micro_batches == acc and (acc > 1 or pm.plan.pipeline is not None):
            loss = pm.train_step(_concat(micro))
            self.micro_steps += acc - 1
            self._boundary_override, old = True, self._boundary_override
            try:
                self.step()
            finally:
                self._boundary_override = old
        else:
            total = None
            for mb in micro:
                out = self._call(mb)
                raw = require_scalar_loss(extract_loss(out), out)
                self.backward(raw)
                self.step()
                total = raw.detach() if total is None else total + raw.detach()
            loss = total / acc
        loss = loss.detach().clone()
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(loss)
            loss /= self.world_size
        return loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Any:
        """DeepSpeed's PipelineEngine.eval_batch: the model in eval mode, without gradients, on
        `num_micro_batches` (default gradient_accumulation_steps) micro-batches from `data_iter`; the
        mean loss over them and the data-parallel ranks (`reduce_output="avg"`), or the list of
        per-micro-batch losses (None). With `return_logits`, (loss, the last micro-batch's outputs).
        The train/eval mode is put back as it was."""
        if self._pmodule is not None and self._pmodule.plan.pipeline is not None:
            raise RuntimeError("eval_batch under a pipeline plan is not supported: the plan's pipeline runs training "
                               "steps only; evaluate under a non-pipeline plan (e.g. 'nnscaler': {'plan': 'dp'}) or "
                               "run the model's own forward on whole weights (engine.module_state_dict())")
        if not compute_loss and not return_logits:
            raise ValueError("eval_batch with compute_loss=False returns the outputs: pass return_logits=True")
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output={reduce_output!r}: DeepSpeed takes 'avg' or None")
        n = num_micro_batches if num_micro_batches is not None else self.gradient_accumulation_steps()
        was_training = self._model.training
        self.eval()
        losses, logits = [], None
        try:
            with torch.no_grad():
                for _ in range(n):
                    mb = next(data_iter)
                    if compute_loss:
                        out = self._call(self._micro_batch(mb))
                        losses.append(require_scalar_loss(extract_loss(out), out).detach().clone())
                    if return_logits:
                        inputs = mb[0] if isinstance(self._model, PipelineModule) else mb
                        logits = self._call(inputs if isinstance(inputs, (dict, tuple)) else (inputs,))
        finally:
            self.train(was_training)
        loss = None
        if compute_loss:
            if reduce_output == "avg":
                loss = torch.stack(losses).mean()
                if dist.is_initialized() and self.world_size > 1:
                    dist.all_reduce(loss)
                    loss /= self.world_size
            else:
                loss = losses
        return (loss, logits) if return_logits else loss

    def _micro_batch(self, batch: Any) -> Any:
        """A batch from a data iterator as what one call of the model takes: a PipelineModule's
        `(inputs, labels)` become its two arguments."""
        return pipeline_call(batch) if isinstance(self._model, PipelineModule) else batch

    def _call(self, mb: Any) -> Any:
        if isinstance(mb, dict):
            return self(**mb)
        if isinstance(self._model, PipelineModule) and isinstance(mb, tuple):
            return self(*mb)
        return self(mb)

    # -- what scripts read --------------------------------------------------------------------------
    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The 2-norm of all gradients at the last optimizer step, before clipping (None before it)."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_optimization_stage(self) -> int:
        return self._settings.zero_stage

    def zero_optimization(self) -> bool:
        return self._settings.zero_stage > 0

    def gradient_clipping(self) -> float:
        return self._settings.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self._settings.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._settings.precision == "bf16"

    def steps_per_print(self) -> int:
        return self._settings.steps_per_print

    @property
    def config(self) -> dict:
        return self._config

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = False, data_sampler: Any = None, collate_fn: Optional[Callable] = None,
                     num_local_io_workers: Optional[int] = None) -> torch.utils.data.DataLoader:
        """A loader of micro-batches for this data-parallel rank, sampled as DeepSpeed's is
        (a DistributedSampler over the data-parallel ranks, shuffled with seed 0)."""
        if data_sampler is None:
            data_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                                               rank=self.dp_rank, shuffle=route == "train")
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                           sampler=data_sampler, collate_fn=collate_fn, pin_memory=pin_memory,
                                           num_workers=num_local_io_workers or 0,
                                           drop_last=self._settings.dataloader_drop_last)

    # -- state --------------------------------------------------------------------------------------
    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """Whole weights under the model's own names, in the training dtype (collective once
        parallelized)."""
        with self._whole():
            self._materialize()
            state = self._pmodule.full_state_dict() if self._pmodule is not None else \
                {k: v.detach().clone() for k, v in self._model.state_dict().items()}
            custom = self._model.__dict__.get("state_dict")
            if custom is not None:  # the script gave the model its own state_dict: its entries are what is saved
                state = {k: state[k] if k in state else v.detach().clone() for k, v in custom().items()}
        if exclude_frozen_parameters:
            state = {k: v for k, v in state.items() if k not in self._frozen_names()}
        return {prefix + k: v for k, v in state.items()}

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True, custom_load_fn: Any = None,
                               fetch_z3_params: bool = False) -> None:
        """Whole weights (or a DeepSpeed checkpoint dict holding them under "module") into the model."""
        state = checkpoint["module"] if "module" in checkpoint and isinstance(checkpoint["module"], dict) \
            else checkpoint
        if self._pmodule is not None:
            self._pmodule.load_full_state_dict(state)
        else:
            self._model.load_state_dict(state, strict=strict)

    def _frozen_names(self) -> set:
        return {n for n, p in self._model_params.items() if not p.requires_grad}

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Whole weights in one file, written by rank 0 (every rank must call it). Kept in the
        training dtype: fp32 stays fp32."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return True

    def _check_tag(self, tag: str) -> None:
        """checkpoint.tag_validation: every rank must save under the same tag (DeepSpeed's check)."""
        mode = self._settings.tag_validation
        if mode == "IGNORE" or not dist.is_initialized() or self.world_size == 1:
            return
        tags: list = [None] * self.world_size
        dist.all_gather_object(tags, str(tag))
        if len(set(tags)) > 1:
            msg = f"checkpoint tag {tag!r} is not consistent across all ranks: {tags}"
            if mode == "FAIL":
                raise AssertionError(msg)
            log.warning(msg)

    def _groups_and_masters(self) -> tuple[list[list[str]], dict[str, torch.Tensor], dict[str, dict]]:
        """Each optimizer group's trainable parameter names, their fp32 master values and their whole
        optimizer state by name (empty where the plan's optimizer does not hold it yet; collective)."""
        opt = self.optimizer
        if self._pmodule is None or opt is None:
            groups = [[self._model_param_names[id(p)] for p in g["params"]
                       if id(p) in self._model_param_names and p.requires_grad] for g in opt.param_groups] \
                if opt is not None else [[n for n, p in self._model_params.items() if p.requires_grad]]
            with self._whole():
                self._materialize()
                whole = {n: p.detach().float().clone()
                         for n, p in self._model.named_parameters(remove_duplicate=False)}
            if self._pmodule is not None:
                whole = {n: t.float() for n, t in self._pmodule.full_state_dict().items()}
            return groups, {n: whole[n] for g in groups for n in g}, {}
        if isinstance(opt, ZeroOptimizer):
            full = opt.inner.full_state_dict()
            groups = [list(g) for g in opt.group_names]
            whole = None
            masters = {}
            for g in groups:
                for n in g:
                    m = full["state"].get(n, {}).get("master_param")
                    if m is None:
                        whole = whole if whole is not None else self._pmodule.full_state_dict()
                        m = whole[n]
                    masters[n] = m.float()
            return groups, masters, full["state"]
        whole = self._pmodule.full_state_dict()
        groups = [[self._model_param_names[id(p)] for p in g["params"] if id(p) in self._model_param_names]
                  for g in opt.param_groups]
        return groups, {n: whole[n].float() for g in groups for n in g}, {}

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's layout (`latest`, `<tag>/` with its model and optimizer state files) around a
        reshardable checkpoint of this engine; every rank must call it. Works before the first
        forward too (the model as it is, no optimizer state yet)."""
        if not save_dir:  # DeepSpeed's check and message
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        self._check_tag(tag)
        groups, masters, moments = self._groups_and_masters()
        module_state = self.module_state_dict()
        frozen_names = self._frozen_names()
        frozen = {} if exclude_frozen_parameters else {n: module_state[n].float() for n in frozen_names
                                                      if n in module_state}
        if exclude_frozen_parameters:
            module_state = {k: v for k, v in module_state.items() if k not in frozen_names}
        buffers = [n for n, _ in self._model.named_buffers()]
        extra = dict(client_state or {})
        extra.update({"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                      "ds_config": self._config, **self._counters(),
                      "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                       for g in self.optimizer.param_groups] if self.optimizer is not None else None})
        ckpt.save(save_dir, tag, module_state=module_state, buffer_names=buffers, groups=groups, masters=masters,
                  frozen=frozen, shared=self._tied, extra=extra, zero_stage=self.zero_optimization_stage(),
                  precision=self._settings.precision, dp=self.dp_world_size, dp_rank=self.dp_rank,
                  parallel=self._pmodule, optimizer=self._stepping_optimizer() if self._pmodule is not None else None,
                  save_latest=save_latest, moments=moments, clip_grad=self.gradient_clipping())
        return True

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: str, expp_rank: int = 0) -> str:
        """DeepSpeed's name of the file holding this rank's optimizer state in checkpoint `tag`."""
        return os.path.join(checkpoints_path, str(tag),
                            ckpt.optim_file(self.zero_optimization_stage(), self._settings.precision, self.dp_rank))

    def _counters(self) -> dict:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps}

    _ENGINE_KEYS = ("module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                    "shared_params", "dp_world_size", "mp_world_size", "ds_version", "lr_scheduler", "ds_config",
                    "global_steps", "global_samples", "micro_steps", "skipped_steps", "optimizer",
                    "param_groups", ckpt.UNIVERSAL_INFO)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Optional[Callable] = None
                        ) -> tuple[Optional[str], Optional[dict]]:
        """Returns (path, client_state), or (None, None) when `load_dir` has no `latest` and no tag was
        given. The weights apply at once (into the model before it is parallelized); the optimizer
        state, under whatever plan and world size this job has, once it is parallelized."""
        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn is not supported; load the state yourself from the path "
                                      "engine.load_checkpoint returns")
        if self._settings.load_universal:
            return self._load_universal(load_dir, tag, load_module_strict, load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only)
        tag = ckpt.resolve_tag(load_dir, tag)
        if tag is None:
            log.warning("unable to find latest file at %s, if trying to load latest checkpoint please pass an "
                        "explicit tag or make sure 'latest' exists", os.path.join(load_dir, ckpt.LATEST))
            return None, None
        path = os.path.join(load_dir, tag)
        states = ckpt.read_states(path)
        parallel_dir = ckpt.nns_dir(path)
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        module_state = states["module"]
        if self._pmodule is not None:
            if parallel_dir is not None:
                ckpt.load_parallel(parallel_dir, self._pmodule,
                                   self._stepping_optimizer() if with_optimizer else None, load_module_strict)
            else:
                self._pmodule.load_full_state_dict({**self._pmodule.full_state_dict(), **module_state})
        else:
            with self._whole():
                self._materialize()  # a meta model: whole here, as the checkpoint's module state is
                missing = self._model.load_state_dict(module_state, strict=False)
            absent = [k for k in missing.missing_keys if k not in self._frozen_names()]
            if load_module_strict and (absent or missing.unexpected_keys):
                raise RuntimeError(f"Error(s) in loading state_dict: missing keys {absent}, unexpected keys "
                                   f"{missing.unexpected_keys}")
            if parallel_dir is not None and with_optimizer:
                self._pending_load = (parallel_dir, True, load_module_strict)
        return self._finish_load(path, states, with_optimizer, load_lr_scheduler_states, load_module_only)

    def _finish_load(self, path: str, states: dict, with_optimizer: bool, load_lr_scheduler_states: bool,
                     load_module_only: bool, groups: Optional[list] = None) -> tuple[str, dict]:
        """Hyperparameters, scheduler and counters from the model states file; the client state."""
        groups = states.get("param_groups") or groups
        if with_optimizer and groups:  # the hyperparameters apply at once
            self._set_hyperparameters(groups)
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and states.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(states["lr_scheduler"])
            for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
                if k in states:
                    setattr(self, k, states[k])
        client = {k: v for k, v in states.items() if k not in self._ENGINE_KEYS}
        return path, client

    def _load_universal(self, load_dir: str, tag: Optional[str], strict: bool, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict]:
        """checkpoint.load_universal: the whole fp32 weights and optimizer state of a folder DeepSpeed's
        ds_to_universal wrote, loaded under this job's ZeRO stage, plan and world size."""
        tag = universal.resolve_tag(load_dir, tag)
        path = os.path.join(load_dir, tag)
        states = ckpt.read_states(path)
        trainable = {n: self._whole_shapes[n] for n, p in self._model_params.items() if p.requires_grad}
        weights, opt_state, groups = universal.read(path, trainable)
        module_state = dict(states["module"])
        for name, value in weights.items():  # in this model's dtype (the fp32 masters go to the optimizer)
            module_state[name] = value.to(self._model_params[name].dtype)
        for alias, name in self._tied.items():
            if name in weights and alias in module_state:
                module_state[alias] = module_state[name]
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        if with_optimizer and not isinstance(self.optimizer, ZeroOptimizer):
            raise NotImplementedError("checkpoint.load_universal loads the optimizer state into the plan's optimizer "
                                      "(ZeRO >= 1, or bf16/fp16); under ZeRO-0 fp32 pass load_optimizer_states=False "
                                      "or set zero_optimization.stage >= 1")
        if self._pmodule is not None:
            self._pmodule.load_full_state_dict({**self._pmodule.full_state_dict(), **module_state})
            if with_optimizer:
                self._stepping_optimizer().load_full_state_dict({"state": opt_state})
        else:
            with self._whole():
                self._materialize()
                missing = self._model.load_state_dict(module_state, strict=False)
            absent = [k for k in missing.missing_keys if k not in self._frozen_names()]
            if strict and (absent or missing.unexpected_keys):
                raise RuntimeError(f"Error(s) in loading state_dict: missing keys {absent}, unexpected keys "
                                   f"{missing.unexpected_keys}")
            if with_optimizer:
                self._pending_state = opt_state
        return self._finish_load(path, states, with_optimizer, load_lr_scheduler_states, load_module_only, groups)

    def _set_hyperparameters(self, saved: list) -> None:
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved)} param groups, this one "
                             f"{len(self.optimizer.param_groups)}")
        for group, values in zip(self.optimizer.param_groups, saved):
            for k, v in values.items():
                if isinstance(group.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = v

    def destroy(self) -> None:
        """Nothing to release beyond what garbage collection does; kept for DeepSpeed's API."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            inner = self.__dict__.get("_pmodule") or self.__dict__.get("_model")
            if inner is None:
                raise
            return getattr(inner, name)


def _has_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _agreed_seed() -> int:
    """Rank 0's torch seed, on every rank."""
    seed = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _repeat(loader: Any) -> Iterator:
    """DeepSpeed's RepeatingLoader: start over at the end of the data."""
    while True:
        yield from loader
