"""ParallelModule: runs this rank's generated program and holds only this rank's parameter shards.

Used like DDP: `out = module(**batch); out.loss.backward()` (gradient reducers fire during
backward; `no_sync()` skips them for accumulation), or `module.train_step(batch)`.

What the optimizer, checkpoints, adapters and tests read of it, besides the plan, program and
dp_rank / dp_size: `held_keys` and `local_tensor(key)` (this device's shards), `parameter(fqn)`,
`counts_in_norm(key)`, `device`, `grad_reducer`, `zero_shards` / `zero3`, `whole_tensor(...)` and
`share_in_unit(...)`. Its set-up lives next to it: `plan_groups.py` (process groups), `comm.py`,
`zero_setup.py`, `grad_reducer_setup.py`, `params_on_use.py`; the pipeline executor sees only a
`StageRuntime`.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler_plugins.batches import ForwardArguments, input_at, normalize_inputs, split_batch
from nnscaler_plugins.compiler.loss_items import samples
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.kernels.collectives import saved_tensor_hooks
from nnscaler_plugins.kernels.coshard import active_meter
from nnscaler_plugins.kernels.float8 import WeightCast, check_float8
from nnscaler_plugins.kernels.piece_rng import agree_seed, set_stream_state, stream_state
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.outputs import extract_loss, non_scalar_loss, require_scalar_loss
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.runtime.comm import Comm
from nnscaler_plugins.runtime.eager_executor import EagerExecutor, eager_source
from nnscaler_plugins.runtime.eager_fallback import fallback_problem
from nnscaler_plugins.runtime.flight_recorder import OUTSIDE, FlightRecorder
from nnscaler_plugins.runtime.grad_clip import counts_in_norm
from nnscaler_plugins.runtime.grad_reducer import GradReducer
from nnscaler_plugins.runtime.grad_reducer_setup import build_reducer
from nnscaler_plugins.runtime.materialize import InitError, has_meta_tensors, materialize, move_tensor
from nnscaler_plugins.runtime.nonfinite import NonFiniteGuard
from nnscaler_plugins.runtime.params_on_use import first_gathered, params_on_use
from nnscaler_plugins.runtime.pipeline_executor import PipelineExecutor, StageRuntime
from nnscaler_plugins.runtime.plan_groups import UnitGroups, create_groups
from nnscaler_plugins.runtime.precision import autocast, compute_dtype
from nnscaler_plugins.runtime.watchdog import WATCHDOG, default_timeout_s
from nnscaler_plugins.runtime.zero import PendingGather, Zero3Params
from nnscaler_plugins.runtime.zero_setup import chunk_parameters, float8_gathered, zero_shards

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.capture.graph import Graph
    from nnscaler_plugins.compiler.artifact import Artifact


def _safe(fqn: str) -> str:
    return fqn.replace(".", "__")


class ParallelModule(torch.nn.Module):
    """Runs one rank's compiled artifact (`nns.compile(...).artifact_for_rank(rank)`, made for it by
    `nns.parallelize`). `model` gives the initial weights (a meta-device model is initialized piece by
    piece instead); the module keeps only this rank's pieces."""

    def __init__(self, artifact: "Artifact", model: Optional[torch.nn.Module], *, rank: int, world_size: int,
                 device: Optional[torch.device] = None, loss_fn: Optional[Callable] = None,
                 init_seed: Optional[int] = None):
        super().__init__()
        program = artifact.program
        if artifact.unit_device != rank % program.unit_size:
            raise ValueError(f"rank {rank} runs device {rank % program.unit_size} of the unit, but the artifact is "
                             f"device {artifact.unit_device}'s; use compiled.artifact_for_rank({rank})")
        plan = program.plan
        if world_size != plan.world_size:
            raise ValueError(f"plan is for {plan.world_size} processes, this job has {world_size}")
        plan.check_runnable()
        if plan.precision == "fp8":
            check_float8(torch.device(device) if device is not None else torch.device("cpu"), plan.knobs.fp8_emulate)
        self.program = program
        self.plan: Plan = plan
        # The model's own forward runs (runtime/eager_executor.py) instead of generated code: set once the
        # shards exist, below.
        self.eager: Optional[EagerExecutor] = None
        is_eager = plan.knobs.executor == "eager"
        self.eager_only = is_eager  # every forward runs the model's own code (else: only those `_eager_for` says)
        if is_eager and model is None:
            raise ValueError("a plan that runs the model's own forward (executor='eager') needs the model")
        self.graph: "Graph" = program.graph
        self.artifact = artifact
        self.rank = rank
        # this rank on the plan's mesh ({"dp": 1, "pp": 0, "tp": 1}); the replicas are its outer axes
        self.coordinate = plan.mesh.coordinate(rank)
        self.unit_device = rank % plan.unit_size
        self.dp_rank = rank // plan.unit_size
        self.dp_size = plan.dp
        self.loss_fn = loss_fn
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        # process groups from the plan's mesh (its DeviceMesh) and the sets the program communicates over
        self.groups, self.device_mesh = create_groups(program, world_size,
                                                      "cuda" if self._device.type == "cuda" else "cpu")
        # Faults: positions in the program (the watchdog reads them when a collective hangs), and the
        # check of each step's loss and gradients (runtime/flight_recorder.py, watchdog.py, nonfinite.py).
        self.flight_recorder = FlightRecorder(program, self.unit_device, self.dp_rank * plan.unit_size)
        self.nonfinite = NonFiniteGuard(self)
        # what replay_last_forward runs again: (kind, inputs, whether the model's own forward ran them)
        self._last_forward: Optional[tuple[str, Any, bool]] = None
        self._comm = Comm(program, self.unit_device, UnitGroups(self.groups, self.dp_rank * plan.unit_size),
                          self.flight_recorder)
        if program.draws:  # random ops seeded per piece (kernels/piece_rng.py): one base seed on every rank
            agree_seed(self._comm, self._device if self._device.type != "meta" else None)
        self.source_path = artifact.source_path
        # Other batch sizes and lengths than the example's: the compile stage's callback makes their programs.
        self.shape_programs = artifact.shapes
        # Whether this device's forward runs collectives of its own (programs for other sizes run the same
        # ones): without, no saved input is an all-gathered one kept as its shard. A forward that only
        # computes may run while the replicas agree on the step's sizes (`_agree_begin`).
        self._forward_communicates = program.forward_communicates(self.unit_device) or plan.zero >= 3
        self._forward_is_local = (program.forward_is_local(self.unit_device) and plan.zero < 3
                                  and plan.precision != "fp8" and plan.pipeline is None and not is_eager)
        self._loss_items = artifact.loss_items
        self._step: Optional[list[tuple[tuple, dict, list]]] = None  # the pipeline step's micro-batches
        self._micro_weights: list[float] = []
        self._loss_output_checked = False
        # A batch entry the captured program does not read is refused or warned about, never dropped silently.
        self._forward_arguments = ForwardArguments(model)
        self._captured_kwargs = {s.path[1] for s in program.graph.inputs if s.path[0] == "kwargs"}
        self._captured_args = 1 + max((s.path[1] for s in program.graph.inputs if s.path[0] == "args"), default=-1)
        # The example's flags and numbers the program holds as constants: a call giving others runs eagerly or is refused.
        self._settings: dict = getattr(program.graph, "settings", None) or {}
        # The loss of this replica's own batch in the last train_step (it returns the global batch's).
        self.local_loss: Optional[torch.Tensor] = None

        # Local shards: parameters become nn.Parameters, buffers and constants plain buffers.
        rp = program.ranks[self.unit_device]
        self._held = rp.params
        self.shards = torch.nn.ParameterDict()
        state = _full_tensors(model) if model is not None else {}
        dtype = compute_dtype(plan.precision)
        # A model on the meta device: shards are shapes until `_materialize` fills them below.
        on_meta = model is not None and has_meta_tensors(model)
        chunked = plan.zero >= 3 and plan.dp > 1  # trainable parameters are replaced by ZeRO-3 chunks
        for v in self._held:
            s = program.shards[v]
            full = state.get(s.fqn) if s.kind != "constant" else self.graph.constants.get(s.fqn)
            lay = s.layout
            if is_eager and _keeps_as_is(full, s.kind, self._device, dtype, chunked and s.kind == "param"
                                         and self.graph.meta(s.value).requires_grad):
                # the model's own tensor, whole on this device already: this shard is it (as under DDP),
                # so an optimizer built over model.parameters() before parallelizing steps the trained one
                if s.kind == "param":
                    self.shards[_safe(s.fqn)] = full
                else:
                    self.register_buffer(_safe(s.fqn), full, persistent=s.in_state_dict)
                continue
            if on_meta and full is not None and full.is_meta:
                local = torch.empty(lay.local_shape(), dtype=self.graph.meta(s.value).dtype, device="meta")
            elif full is None or full.is_meta:
                local = torch.empty(lay.local_shape(), dtype=self.graph.meta(s.value).dtype, device=self._device)
            elif chunked and s.kind == "param" and self.graph.meta(s.value).requires_grad:
                # only its ZeRO-3 chunk is kept (copied by chunk_parameters): no copy of the whole piece
                local = lay.slice_full(full.detach(), self.unit_device).to(self._device)
            else:
                local = lay.slice_full(full.detach(), self.unit_device).to(self._device, copy=True)
            if s.kind == "param":
                if local.is_floating_point():  # bf16 / fp16: the module holds the compute-dtype copy
                    local = local.to(dtype)
                self.shards[_safe(s.fqn)] = torch.nn.Parameter(local,
                                                               requires_grad=self.graph.meta(s.value).requires_grad)
            else:
                self.register_buffer(_safe(s.fqn), local, persistent=s.in_state_dict)
        # The loss is multiplied by this before backward (fp16 loss scaling; the optimizer sets it).
        self.loss_scale = 1.0
        # ZeRO-1/2's gathers of updated weights, which the optimizer leaves in flight for the next
        # forward: whatever reads or writes parameters outside it waits for them first.
        self.param_gather = PendingGather()
        self.register_state_dict_pre_hook(lambda m, *_: m.param_gather.wait_all())
        self.register_load_state_dict_pre_hook(lambda m, *_: m.param_gather.wait_all())
        # Set by nns.build_optimizer: ZeRO-2's gradient chunks have a reader (see `_scatter_gradients`).
        self.sharded_optimizer = False
        self._warned_whole_gradients = False
        trainable = [v for v in self._held if program.shards[v].kind == "param"
                     and self.graph.meta(program.shards[v].value).requires_grad]
        # Per trainable parameter (by fqn), the chunk of it this replica owns under ZeRO.
        self.zero_shards = zero_shards(program, trainable, self.parameter, self.unit_device, self.dp_rank,
                                       self.groups)
        self.zero3: Optional[Zero3Params] = None
        self._zero3_key: dict[str, int] = {}  # fqn -> its key in zero3
        if plan.zero >= 3 and plan.dp > 1:  # each trainable parameter becomes the chunk this replica owns
            self.zero3, chunks = chunk_parameters(self.zero_shards, self.parameter, plan.dp,
                                                  host=plan.offload == "params", device=self._device)
            for fqn, chunk in chunks.items():
                self.shards[_safe(fqn)] = chunk
            self._zero3_key = {fqn: i for i, fqn in enumerate(chunks)}
            gathered = [self._zero3_key[f] for f in float8_gathered(program, self.unit_device) if f in self._zero3_key]
            if gathered:  # the weights of float8 linears travel as float8 (plan knob fp8_all_gather)
                self.zero3.gather_in_float8(gathered, WeightCast(plan.knobs.fp8_recipe, plan.knobs.fp8_emulate))
        # the parameter a train step's forward reads first, gathered beside the step's agreement on sizes
        self._first_zero3 = (first_gathered(program, program.ranks[self.unit_device].stages[0].params, self._zero3_key)
                             if self.zero3 is not None and plan.pipeline is None else None)
        # The base seed a meta-device model was initialized from (None when the model came with weights).
        self.init_seed: Optional[int] = None
        self.init_peak_bytes = 0
        if on_meta:
            self.init_seed = torch.initial_seed() if init_seed is None else int(init_seed)
            self.init_peak_bytes = self._materialize(model, self.init_seed)
        # ZeRO-3 reduces its gradients from the gathers' backward
        self._reducer = None if self.zero3 is not None else build_reducer(
            program, trainable, self.parameter, self.unit_device, self.groups, self.zero_shards,
            self._scatter_gradients)
        if self.zero3 is not None:  # a hang in a gather or a reduce-scatter names it and its parameters
            self.zero3.recorder = self.flight_recorder
        if self._reducer is not None:  # a hang in a bucket's reduction names the bucket and its parameters
            self._reducer.recorder = self.flight_recorder
            self._reducer.names = {id(self.parameter(program.shards[v].fqn)): program.shards[v].fqn for v in trainable}
        self._executor = PipelineExecutor(StageRuntime(
            program=program, unit_device=self.unit_device, global_rank=self._comm.groups.global_rank,
            generated=self._micro_batch_program, comm=self._comm, device=self._device,
            params_on_use=self._params_on_use, stage_parameters=self._stage_parameters, zero3=self.zero3,
            loss_scale=lambda: self.loss_scale, boundary_shape=self._boundary_shape,
            micro_weight=lambda mb: self._micro_weights[mb], recorder=self.flight_recorder)) \
            if plan.pipeline is not None else None
        if is_eager:
            self.eager = EagerExecutor(self, model)
            self.train(model.training)
        # A captured plan that keeps whole layers on each device runs the model's own forward for sizes
        # its captured program cannot take (the executor is bound at the first such batch): None when
        # it cannot, `no_fallback` then says why.
        # (kept outside nn.Module's registry: the user's model is no submodule, its parameters none of ours)
        object.__setattr__(self, "_fallback_model", None)
        self.no_fallback = "the plan runs the model's own forward already"
        if not is_eager:
            self.no_fallback = fallback_problem(plan, model, program)
            if self.no_fallback is None:
                object.__setattr__(self, "_fallback_model", model)
                if self._reducer is not None:  # either executor's backward may run on a replica: DDP's order
                    self._reducer.in_order = True
        # Which executor the forwards of the batch the replicas last agreed on run (`_agree_begin`).
        self._agreed_eager: Optional[bool] = None
        if world_size > 1:
            self._watch()

    # -- set-up ---------------------------------------------------------------------------------
    def _materialize(self, model: torch.nn.Module, seed: int) -> int:
        """Fill the shards of a meta-device model by its own initialization (materialize.py): each
        whole tensor this device holds a piece of is made on CPU, sliced into the piece (under
        ZeRO-3 the chunk this replica owns) and freed. Returns the peak bytes of whole tensors held."""
        wanted: dict[str, list[str]] = {}
        for v in self._held:
            s = self.program.shards[v]
            t = self.local_tensor(v)
            if s.kind == "constant" or not t.is_meta:
                continue
            move_tensor(t, self._device)
            for n in (s.fqn, *s.aliases):
                wanted.setdefault(n, []).append(v)
        filled: set[str] = set()

        def take(names: list[str], full: torch.Tensor) -> None:
            for v in dict.fromkeys(v for n in names for v in wanted.get(n, ())):
                s = self.program.shards[v]
                piece = s.layout.slice_full(full, self.unit_device)
                if s.fqn in self._zero3_key:
                    piece = self.zero_shards[s.fqn].owned(piece.reshape(-1))
                with torch.no_grad():
                    self.local_tensor(v).copy_(piece)
                filled.add(v)
        peak = materialize(model, seed, take, names=set(wanted))
        missing = sorted({self.program.shards[v].fqn for ns in wanted.values() for v in ns} -
                         {self.program.shards[v].fqn for v in filled})
        if missing:
            raise InitError(f"the meta-device model's initialization gave no value for {missing[:8]}")
        return peak

    def _scatter_gradients(self) -> bool:
        """Whether ZeRO-2 keeps only this replica's chunk of each gradient (outside `.grad`) in this
        reduction. Only the optimizer `nns.build_optimizer` made reads the chunks; a plain torch
        optimizer over `parameters()` reads `.grad` and would skip every sharded parameter, so until
        one exists the gradients are all-reduced whole into `.grad` (stage 1's communication and
        memory), and any optimizer steps exactly."""
        if self.sharded_optimizer:
            return True
        if not self._warned_whole_gradients:
            self._warned_whole_gradients = True
            if self.rank == 0:
                warnings.warn("zero=2 without nns.build_optimizer: gradients are all-reduced whole into .grad (as "
                              "at stage 1) so that an optimizer over module.parameters() steps exactly; build it "
                              "with nns.build_optimizer(module, torch.optim.<Class>, ...) to shard them", stacklevel=2)
        return False

    # -- what the optimizer, checkpoints, adapters and tests read ----------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank's shards live and its generated code runs."""
        return self._device

    @property
    def held_keys(self) -> list[str]:
        """Keys (into `program.shards`) of the parameters, buffers and constants this device holds,
        in Program order."""
        return self._held

    def local_tensor(self, key: str) -> torch.Tensor:
        """This device's tensor of shard `key` (one of `held_keys`): its Parameter (under ZeRO-3 the
        chunk this replica owns) or buffer."""
        self.param_gather.wait_all()
        return self._tensor(key)

    def tensor_of(self, key: str) -> torch.Tensor:
        """`local_tensor` without waiting for ZeRO-1/2's gathers in flight: the tensor object itself (its
        values may still be arriving), for code that binds it now and reads it later."""
        return self._tensor(key)

    @property
    def zero3_index(self) -> dict[str, int]:
        """Each ZeRO-3-chunked parameter's key in `zero3`, by fqn (empty without ZeRO-3)."""
        return dict(self._zero3_key)

    def _tensor(self, key: str) -> torch.Tensor:
        """`local_tensor` without waiting for gathers in flight (the forward waits per parameter)."""
        s = self.program.shards[key]
        return self.shards[_safe(s.fqn)] if s.kind == "param" else getattr(self, _safe(s.fqn))

    def parameter(self, fqn: str) -> Optional[torch.nn.Parameter]:
        """This rank's Parameter of the model's parameter `fqn` (its piece; under ZeRO-3 the chunk
        this replica owns); None where this device holds none of it."""
        key = _safe(fqn)
        self.param_gather.wait_all()
        return self.shards[key] if key in self.shards else None

    def counts_in_norm(self, key: str) -> bool:
        """Whether this device's copy of shard `key` counts in a global gradient norm: of the unit
        devices (and tied copies) holding the same piece, only the first does."""
        return counts_in_norm(self.program, key, self.unit_device)

    def gradients_alike_by_plan(self) -> bool:
        """Whether this plan leaves every rank the same whole gradients after a synchronized
        backward: plain data parallelism over the whole world (one device per replica, no pipeline,
        no ZeRO sharding), every gradient all-reduced over every rank."""
        p = self.plan
        return (p.unit_size == 1 and p.pipeline is None and p.zero == 0 and p.dp == p.world_size
                and self._reducer is not None)

    def gradients_alike(self) -> bool:
        """Whether every rank holds the same gradients now: `gradients_alike_by_plan`, and no
        backward under `no_sync` accumulated local ones since the last reduction."""
        return self.gradients_alike_by_plan() and not self._reducer.local_since_reduce

    @property
    def grad_reducer(self) -> Optional[GradReducer]:
        """The reducer of the gradients several devices hold whole (None when there are none, and
        under ZeRO-3, whose gathers reduce their own gradients)."""
        return self._reducer

    def share_in_unit(self, key: str, tensor: torch.Tensor) -> None:
        """Devices of this replica's unit that hold none of shard `key` (another pipeline stage's)
        receive `tensor` in place from the first device that holds it; nothing happens when every
        unit device holds it. Collective over the unit: every device calls it, in one order."""
        lay = self.program.shards[key].layout
        if len(lay.group) < self.plan.unit_size:
            dist.broadcast(tensor, src=self._comm.groups.global_rank(lay.group[0]), group=self._unit_group())

    def _unit_group(self) -> Any:
        """The group of every device of this replica's unit (None with one device)."""
        return self.groups.get(tuple(self.dp_rank * self.plan.unit_size + d for d in range(self.plan.unit_size)))

    # -- running ----------------------------------------------------------------------------------
    def _stage_parameters(self, stage: int) -> list[torch.nn.Parameter]:
        """The trainable Parameters (ZeRO-3: chunks) whose gradients stage `stage` computes."""
        out, seen = [], set()
        for key in self.program.ranks[self.unit_device].stages[stage].params:
            t = self._tensor(key)  # the Parameter objects, not their values: no gather waited for
            if isinstance(t, torch.nn.Parameter) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def _params_on_use(self, stage: int = 0) -> Any:
        """What stage `stage`'s generated code unpacks as `_P` (see `runtime/params_on_use.py`)."""
        return params_on_use(self.program, self.program.ranks[self.unit_device].stages[stage].params,
                             self._tensor, self.plan.precision, self.zero3, self._zero3_key, self.param_gather)

    def _flat_inputs(self, args: tuple, kwargs: dict, on_device: bool = True) -> list[Any]:
        """The graph inputs from a call, on this module's device (`on_device=False`: where the call
        has them, for counting and checks that need no copy)."""
        self._forward_arguments.check(args, kwargs, self._captured_kwargs, self._captured_args)
        vals = []
        for spec in self.graph.inputs:
            try:
                x = input_at(args, kwargs, spec.path)
            except (IndexError, KeyError) as e:
                if tuple(spec.path) in self._settings:  # a setting left out: `unlike_example` compares its default
                    vals.append(self._settings[tuple(spec.path)])
                    continue
                raise TypeError(f"missing model input {spec.path[1]!r} (the captured forward took "
                                f"{[s.path[1] for s in self.graph.inputs]})") from e
            meta = self.graph.values[spec.name].meta
            if meta is not None:
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"input {spec.path[1]!r} must be a tensor")
                x = x.to(self._device) if on_device else x
            vals.append(x)
        return vals

    def _run_eager(self, args: tuple, kwargs: dict) -> Any:
        """The user's forward (the eager executor), under the plan's precision."""
        if self.eager is None:  # a captured plan's first batch of sizes its program cannot take
            self.eager = EagerExecutor(self, self._fallback_model)
            self.eager.model.train(self.training)
        with autocast(self.plan.precision, self._device):
            return self.eager.run(args, kwargs)

    def _eager_for(self, args: tuple, kwargs: dict) -> bool:
        """Whether this forward runs the model's own code: always under an eager plan; under a captured
        one that can fall back, when the replicas agreed so for this batch (`_agree_begin`), or else when
        the captured program cannot take its sizes -- decided by every replica together where the forward
        communicates (ZeRO-3's gathers, whole-batch statistics), so that all run the same collectives."""
        if self.eager_only:
            return True
        if self._fallback_model is None:
            return False
        agreed, self._agreed_eager = self._agreed_eager, None
        if agreed is not None:
            return agreed
        flat = self._flat_inputs(args, kwargs, on_device=False)
        refused = self._unlike_program(flat, args, kwargs, alone=False) is not None
        if self.dp_size > 1 and self._forward_communicates:
            t = torch.tensor([1.0 if refused else 0.0], dtype=torch.float64,
                             device=self._device if self._device.type != "meta" else "cpu")
            self.flight_recorder.enter(OUTSIDE, "the replicas' agreement on which executor runs this forward "
                                                "(all-reduce over every rank)")
            dist.all_reduce(t)
            self.flight_recorder.leave()
            refused = t.item() > 0
        return refused

    def _unlike_program(self, flat: list[Any], args: tuple, kwargs: dict, alone: bool) -> Optional[str]:
        """Why the captured program cannot run this call as eager would (its sizes, or a setting it was
        not traced with), None when it can; `alone` as in `ShapePrograms.check`."""
        why = self._forward_arguments.unlike_example(args, kwargs, self._settings)
        return why if why is not None else self.shape_programs.check(flat, args, kwargs, alone=alone)

    def _run(self, args: tuple, kwargs: dict, loss_only: bool = False) -> list[Any]:
        inputs = self._flat_inputs(args, kwargs)
        unlike = self._forward_arguments.unlike_example(args, kwargs, self._settings)
        if unlike is not None:
            raise TypeError(f"{unlike}: capture with an example that gives it, or pass the example's value "
                            f"(the model's own forward cannot run it here: {self.no_fallback})")
        run = self.shape_programs.program_for(inputs, args, kwargs)  # refuses sizes the plan cannot split, first
        fn = run.module.forward_loss if loss_only else run.module.forward
        meter = active_meter()  # a measurement around this forward: its hooks give way to these, which report to it
        on_save = meter.count_packed if meter is not None else None
        if self.zero3 is not None:
            scope = self.zero3.forward_scope(on_save)
        elif on_save is not None or self._forward_communicates:
            scope = saved_tensor_hooks(on_save)
        else:  # nothing gathered to keep as a shard: no hook on every saved tensor
            scope = contextlib.nullcontext()
        with scope, autocast(self.plan.precision, self._device):
            flat = fn(self._comm.for_program(run.program), self._device, self._params_on_use(), *inputs)
        return [c if v is None else t for t, v, c in zip(flat, self.graph.outputs, self.graph.output_constants)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.pipeline is not None:
            raise RuntimeError("a pipeline plan runs whole training steps over its micro-batches: call "
                               "train_step(batch) instead of forward")
        if self.plan.num_micro_batches > 1:
            raise RuntimeError(f"this plan cuts each step into {self.plan.num_micro_batches} micro-batches: call "
                               "train_step(batch), or make a plan without micro_batches to call forward")
        args, kwargs = normalize_inputs(args, kwargs) if len(args) == 1 and isinstance(args[0], dict) else \
            normalize_inputs(tuple(args), kwargs)
        rec = self._begin_step()
        eager = self._eager_for(args, kwargs)
        if torch.is_grad_enabled():
            self._last_forward = ("forward", (args, kwargs), eager)
        if eager:
            out = self._run_eager(args, kwargs)
            rec.end_step()
            return out
        flat = self._run(args, kwargs)
        rec.end_step()  # the backward that follows is the caller's; its collectives still record
        return pytree.tree_unflatten(flat, self.graph.out_spec) if self.graph.out_spec is not None else flat[0]

    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward on one batch, cut into the plan's micro-batches; returns the
        (detached) loss of the global batch, every data-parallel replica's together, the same on
        every rank (`local_loss` then holds this replica's). The optimizer step is the caller's.

        Batches may differ in size and length from the example (see compiler/shapes.py). Each
        micro-batch's loss weighs its share of the step's items (targets not ignored, else samples)
        over every data-parallel replica, so the gradients are those of one device on the whole
        batch; the replicas agree on the weights and on any refused size before any of them runs a
        backward (or, where the forward runs collectives, draws or updates statistics, a forward)."""
        self._check_loss_output()
        rec = self._begin_step()
        try:
            micro, problem = split_batch(batch, self.plan.num_micro_batches), None
        except PlanError as e:  # told to the other replicas first, as any refused size is
            micro, problem = [], str(e)
        # a forward without collectives runs while the replicas agree on the step's sizes
        agreed = self._agree_begin(micro, problem, overlap=self._forward_is_local, meanwhile=self._prefetch_first)
        if self.plan.pipeline is not None:
            self._last_forward = ("train_step", micro, False)
            self._micro_weights = agreed()
            loss = self._pipeline_step(micro)
            return self._end_step(loss, self._micro_weights, self._global_loss_begin(loss))
        total, weights, global_loss = None, None, None
        # which executor runs: this replica's own view until the agreement is in, then every replica's
        eager = self.eager_only or bool(self._agreed_eager)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                rec.at("forward", 0, i)
                loss = self._loss_of(mb, eager)
                if weights is None:
                    weights = agreed()
                    now = self.eager_only or bool(self._agreed_eager)
                    if now != eager:
                        # another replica's batch needs the model's own forward: this replica's first one
                        # (captured, collective-free) runs again that way, before any backward
                        eager = now
                        loss = self._loss_of(mb, eager)
                w = weights[i]
                part = loss.detach() * w
                total = part if total is None else total + part
                if last:  # the step's loss is known: its non-finite flag and its sum travel while backward runs
                    self.nonfinite.loss_ready(total)
                    global_loss = self._global_loss_begin(total)
                scale = self.loss_scale * w
                rec.at("backward", 0, i)
                (loss * scale if scale != 1.0 else loss).backward()
        self._last_forward, self._agreed_eager = ("train_step", micro, eager), None
        return self._end_step(total, weights, global_loss)

    def _global_loss_begin(self, weighted: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing this replica's weighted loss over every rank (collective); the returned call
        waits and gives the global batch's loss. The micro-batch weights are items over the step's
        items times the replicas, and every device of a replica holds the same loss, so the sum
        over the world divided by the world size is the loss of one device on the whole batch."""
        if self.dp_size == 1 or weighted.device.type == "meta":
            return lambda: weighted
        t = weighted.detach().to(torch.float64).reshape(1)
        work = dist.all_reduce(t, async_op=True)

        def wait() -> torch.Tensor:
            self.flight_recorder.enter(OUTSIDE, "the all-reduce of the step's loss over every rank")
            work.wait()
            self.flight_recorder.leave()
            return (t[0] / self.plan.world_size).to(weighted.dtype)
        return wait

    def train(self, mode: bool = True) -> "ParallelModule":
        """As `nn.Module.train`; an eagerly run model (not a submodule: its parameters are these shards)
        switches with it, so dropout and batch norm follow."""
        super().train(mode)
        if getattr(self, "eager", None) is not None:
            self.eager.model.train(mode)
        return self

    # -- faults ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Have the process's watchdog watch this module's flight recorder (runtime/watchdog.py)."""
        knobs = self.plan.knobs
        timeout = knobs.collective_timeout_s or default_timeout_s(dist.get_backend())
        WATCHDOG.watch(self.flight_recorder, timeout, knobs.report_dir or "nnscaler_reports", self._device)

    def _begin_step(self) -> FlightRecorder:
        rec = self.flight_recorder
        rec.begin_step()
        if self.plan.world_size > 1 and WATCHDOG.recorder() is not rec:
            self._watch()
        return rec

    def _end_step(self, loss: torch.Tensor, weights: list[float],
                  global_loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The global batch's loss (what `train_step` returns), once `global_loss` gave it; this
        replica's (`loss`, its micro-batches weighted by `weights`) kept as `local_loss` and for the
        non-finite check. Without an optimizer from `nns.build_optimizer` (which checks before it
        steps) the check runs here, and a step to skip drops the gradients (a torch optimizer then
        changes nothing)."""
        whole = global_loss()
        share = sum(weights)  # this replica's items over the mean replica's: 1 when the replicas hold alike
        self.local_loss = loss / share
        self.nonfinite.last_loss = loss
        if not self.sharded_optimizer and self.plan.knobs.on_nonfinite != "ignore":
            self.flight_recorder.at("non-finite check")
            grads = [(self.program.shards[v].fqn, self.local_tensor(v).grad) for v in self._held
                     if self.program.shards[v].kind == "param"]
            if self.nonfinite.check(grads, "train_step"):
                self.zero_grad(set_to_none=True)
        self.flight_recorder.end_step()
        return whole

    def replay_last_forward(self, run: Callable[[Callable[[], Any]], Any]) -> bool:
        """Run the last step's forward again, without gradients, each forward call through
        `run(fn)` (a tracer looking at every statement's output); the flight recorder says which
        micro-batch and stage runs. Collective like the step itself: every rank calls it. False when
        there is nothing to run again."""
        if self._last_forward is None:
            return False
        kind, what, eager = self._last_forward
        if eager:
            return self._replay_eagerly(run)
        rec = self.flight_recorder
        with torch.no_grad():
            if kind == "forward":
                args, kwargs = what
                rec.at("re-run", 0, 0)
                run(lambda: self._run(args, kwargs))
            elif self.plan.pipeline is not None:
                inputs = [flat for _, _, flat in self._step]
                run(lambda: self._executor.forward_only(inputs))
            else:
                for i, mb in enumerate(what):
                    rec.at("re-run", 0, i)
                    run(lambda mb=mb: self._loss_of(mb, False))
        return True

    def _replay_eagerly(self, run: Callable[[Callable[[], Any]], Any]) -> bool:
        """`replay_last_forward` for the model's own forward: run again as in the step (batch norm's
        whole-batch statistics are collectives too), its buffers (running statistics) and the random
        generators given back their state afterwards, so the re-run changes nothing."""
        kind, what, _ = self._last_forward
        calls = [what] if kind == "forward" else [normalize_inputs(mb, None) for mb in what]
        buffers = {n: b.detach().clone() for n, b in self.named_buffers()}
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for i, (args, kwargs) in enumerate(calls):
                self.flight_recorder.at("re-run", 0, i)
                run(lambda a=args, k=kwargs: self._run_eager(a, k))
        with torch.no_grad():
            for n, b in self.named_buffers():
                b.copy_(buffers[n])
        return True

    def _agree(self, micro: list[Any], problem: Optional[str]) -> list[float]:
        """Each micro-batch's weight (its items over the step's, times the replicas: gradients are
        averaged over them); sizes this plan cannot take are refused on every rank at once."""
        return self._agree_begin(micro, problem, overlap=False)()

    def _agree_begin(self, micro: list[Any], problem: Optional[str], overlap: bool,
                     meanwhile: Optional[Callable[[], None]] = None) -> Callable[[], list[float]]:
        """`_agree` in two halves: the all-reduce starts now, and the returned call waits for it and
        gives the weights. With `overlap`, a rank whose own batch fits lets the agreement travel while
        it runs its first forward: allowed only where that forward runs no collective, so a rank that
        refuses its batch (and runs no forward) cannot leave the others waiting inside one.
        `meanwhile` runs right after the all-reduce starts, on every rank, before any wait or refusal:
        a collective that does not depend on the batch (ZeRO-3's first gather) travels beside it."""
        counts, needs_eager = [], False
        falls_back = self._fallback_model is not None
        for mb in micro:
            if self.eager_only:  # the model's own code takes any size; replicas weigh their samples
                counts.append(samples(pytree.tree_leaves(mb)))
                continue
            args, kwargs = normalize_inputs(mb, None)
            flat = self._flat_inputs(args, kwargs, on_device=False)
            why = self._unlike_program(flat, args, kwargs, alone=not falls_back)
            if why is not None and falls_back:  # the model's own forward takes it: no refusal
                needs_eager = True
            elif why is not None:  # said with why the model's own forward does not take it instead
                problem = problem or f"{why} (the model's own forward cannot run it here: {self.no_fallback})"
            counts.append(self._loss_items.count(flat))
        mine = float(sum(counts))
        self._agreed_eager = needs_eager  # this replica's view; every replica's once the agreement is in
        overlap = overlap and not needs_eager
        t, work = None, None
        if self.dp_size > 1:
            t = torch.tensor([mine, 1.0 if problem else 0.0, 1.0 if needs_eager else 0.0], dtype=torch.float64,
                             device=self._device if self._device.type != "meta" else "cpu")
            work = dist.all_reduce(t, async_op=True)
        if meanwhile is not None:
            meanwhile()

        def weights() -> list[float]:
            nonlocal problem
            total = mine * self.dp_size
            if work is not None:
                self.flight_recorder.enter(OUTSIDE, "the step's agreement on batch sizes (all-reduce over every rank)")
                work.wait()
                self.flight_recorder.leave()
                total = t[0].item() / self.plan.unit_size  # every device of a replica counted the same items
                self._agreed_eager = t[2].item() > 0
                if t[1].item() > 0 and problem is None:
                    problem = ("another data-parallel replica's batch has sizes this plan cannot take "
                               "(its rank says which)")
            if problem is not None:
                raise PlanError(problem)
            if total <= 0:
                return [1.0 / len(micro)] * len(micro)
            return [c * self.dp_size / total for c in counts]

        if not overlap or problem is not None or work is None:
            done = weights()
            return lambda: done
        return weights

    def _prefetch_first(self) -> None:
        """Under ZeRO-3 (no pipeline), start gathering the unit the forward reads first."""
        if self.eager_only:  # the one the last forward read first
            first = self.eager.first_key() if self.zero3 is not None else None
            if first is not None:
                self.zero3.prefetch_forward(first)
            return
        if self._first_zero3 is not None:
            self.zero3.prefetch_forward(self._first_zero3)

    def loss_weight(self, batch: Any) -> float:
        """What this replica's mean loss on `batch` is multiplied by before backward so that the
        averaged gradients are one device's on every replica's batch together (its share of the
        items, times the replicas); refuses, on every rank at once, sizes the plan cannot take.
        Collective over all ranks when data-parallel. For adapters that run `forward` + `backward`
        themselves; `train_step` applies it."""
        return self._agree([batch], None)[0]

    def loss_items(self, batch: Any) -> int:
        """The items `batch` holds for this module's loss (targets not ignored, else samples), as
        `train_step` weighs it; no collective. For adapters that weigh several batches against each
        other (gradient accumulation counted over its whole window)."""
        total = 0
        for mb in split_batch(batch, self.plan.num_micro_batches):
            if self.eager_only:
                total += samples(pytree.tree_leaves(mb))
                continue
            args, kwargs = normalize_inputs(mb, None)
            total += self._loss_items.count(self._flat_inputs(args, kwargs, on_device=False))
        return total

    def _micro_batch_program(self, mb: int) -> Any:
        """The program (generated module and its tables) for pipeline micro-batch `mb`, its sizes set."""
        args, kwargs, flat = self._step[mb]
        return self.shape_programs.program_for(flat, args, kwargs)

    def _boundary_shape(self, value: str, mb: int) -> tuple[int, ...]:
        return self.shape_programs.boundary_shape(value, self._step[mb][2])

    def _loss_of(self, batch: Any, eager: bool) -> torch.Tensor:
        args, kwargs = normalize_inputs(batch, None)
        if eager:
            out = self._run_eager(args, kwargs)
            if self.loss_fn is not None:
                return require_scalar_loss(self.loss_fn(out, batch), source="loss_fn")
            return require_scalar_loss(extract_loss(out), out)
        if self.loss_fn is None and self.program.loss_index is not None:
            return self._run(args, kwargs, loss_only=True)[self.program.loss_index]
        flat = self._run(args, kwargs)
        out = pytree.tree_unflatten(flat, self.graph.out_spec) if self.graph.out_spec is not None else flat[0]
        if self.loss_fn is not None:
            return require_scalar_loss(self.loss_fn(out, batch), source="loss_fn")
        return require_scalar_loss(extract_loss(out), out)

    def _check_loss_output(self) -> None:
        """Refuse, before a step communicates, a captured loss output that is not a scalar (a forward
        returning logits): its backward would fail deep in autograd, or under a pipeline
        back-propagate the sum of the logits."""
        i = self.program.loss_index
        if self.loss_fn is not None or i is None or self._loss_output_checked:
            return
        metas = [self.graph.values[o].meta if o is not None else c
                 for o, c in zip(self.graph.outputs, self.graph.output_constants)]
        out = pytree.tree_unflatten(metas, self.graph.out_spec) if self.graph.out_spec is not None else metas[0]
        problem = non_scalar_loss(metas[i], out)
        if problem is not None:
            raise TypeError(problem)
        self._loss_output_checked = True

    def _pipeline_step(self, micro: list[Any]) -> torch.Tensor:
        if self.loss_fn is not None or self.program.loss_index is None:
            raise RuntimeError("a pipeline plan needs the loss computed inside the model (a scalar output, .loss or "
                               "'loss'); loss_fn= is not supported with pipelines")
        self._step = []
        for mb in micro:
            args, kwargs = normalize_inputs(mb, None)
            self._step.append((args, kwargs, self._flat_inputs(args, kwargs)))
        inputs = [flat for _, _, flat in self._step]
        # Gradients of all micro-batches are reduced once, after the last; ZeRO-3's are reduced by
        # the executor as each stage finishes its backward.
        with self._reducer.no_sync() if self._reducer is not None else contextlib.nullcontext():
            loss = self._executor.run(inputs)
        if self._reducer is not None:
            self._reducer.reduce_now()
        # The stage that computes the loss tells every device of the replica.
        src_stage = self.program.output_stage[self.program.loss_index]
        src = self._comm.groups.global_rank(self.program.stage_groups[src_stage][0])
        group = self._unit_group()
        if group is not None:
            self.flight_recorder.enter(OUTSIDE, f"the broadcast of the step's loss from rank {src} to its replica")
            dist.broadcast(loss, src=src, group=group)
            self.flight_recorder.leave()
        return loss

    @property
    def pipeline_stats(self) -> Any:
        """What the last pipeline step measured: peak micro-batches held, peak bytes saved for backward."""
        return None if self._executor is None else self._executor.stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops the gradients kept outside `.grad`: ZeRO-2's reduced chunks and what ZeRO-3
        set aside under no_sync (frameworks that zero the model, not the optimizer, rely on it)."""
        super().zero_grad(set_to_none=set_to_none)
        if self._reducer is not None:
            self._reducer.shard_grads.clear()
        if self.zero3 is not None:
            self.zero3.drop_accumulated()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; nothing is communicated until the
        next backward outside it."""
        with self._reducer.no_sync() if self._reducer is not None else contextlib.nullcontext(), \
                self.zero3.no_sync() if self.zero3 is not None else contextlib.nullcontext():
            yield

    def compile(self, *args: Any, backend: Optional[str] = None, **kwargs: Any) -> None:
        """Run this rank's program under torch.compile from now on, as the plan's `compile` knob
        does: its compiled regions (the runs of ops between collectives, one per distinct layer)
        compiled at their first call, its collectives eager (compiler/regions.py). `backend`: a
        torch.compile backend name (default: the plan's `compile_backend`, inductor)."""
        if args or kwargs or (backend is not None and not isinstance(backend, str)):
            raise TypeError("ParallelModule.compile(backend=None) takes only a backend name: its regions are compiled "
                            "by the compile stage (the plan's compile knob), not as one module")
        art = self.artifact
        if art.compile_backend is not None and backend in (None, art.compile_backend):
            return
        if art.with_compile is None:
            raise RuntimeError("this module's artifact was made without the compile stage's callback; make the plan "
                               "with compile=True instead")
        art = art.with_compile(backend)
        self.artifact, self.shape_programs, self.source_path = art, art.shapes, art.source_path

    def random_stream(self) -> Optional[tuple[int, int]]:
        """(base seed, forwards drawn so far) of this module's per-piece random ops (kernels/piece_rng.py),
        or None when its program draws nothing: checkpoints keep it per rank, so a resumed job
        draws the dropout masks the uninterrupted one would."""
        return stream_state(self._comm) if self._comm.program.draws else None

    def set_random_stream(self, state: tuple[int, int]) -> None:
        """Continue the per-piece random stream from `random_stream()` saved earlier."""
        set_stream_state(self._comm, state)

    def generated_source(self) -> str:
        """The code this rank runs (for an eagerly run plan: a note saying the model's own forward runs)."""
        if self.eager_only:
            return eager_source(self.plan.knobs.eager_reason or "executor='eager' was asked for", self.eager.model)
        with open(self.source_path) as f:
            return f.read()

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False,
                        only: Optional[Collection[str]] = None) -> dict[str, torch.Tensor]:
        """Whole tensors under the model's own names (collective: call on every rank).

        `rank0_only`: only global rank 0 keeps them (the others get an empty dict), so a framework
        checkpoint written by rank 0 costs the other ranks one whole tensor at a time, not a whole
        model each (FSDP's full state dict with `rank0_only` does the same). `only`: just these
        names (every rank passes the same), so fetching one parameter gathers one tensor."""
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        wanted = None if only is None else set(only)
        out: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        for v, s in self.program.shards.items():
            if not s.in_state_dict or s.fqn in seen:  # a tied weight's copies hold the same values
                continue
            if wanted is not None and s.fqn not in wanted and not wanted.intersection(s.aliases):
                continue
            seen.add(s.fqn)
            local = self.local_tensor(v) if v in self._held else None
            dtype = self.graph.meta(s.value).dtype
            if local is not None and self.zero3 is not None and s.fqn in self._zero3_key:
                with torch.no_grad():
                    local = self.zero3.gather([self._zero3_key[s.fqn]])[self._zero3_key[s.fqn]]
            whole = self.whole_tensor(v, None if local is None else local.detach().to(dtype), dtype)
            if not keep:
                del whole
                continue
            t = whole.detach().cpu().clone()
            out[s.fqn] = t
            for a in s.aliases:
                out[a] = t
        return out

    def whole_tensor(self, key: str, local: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor of shard `key` from this device's piece (`local`, None where the device
        holds none of it). Collective over the replica's unit: every device calls it, in one order."""
        from nnscaler_plugins.lower.resharding import plan as plan_reshard

        lay = self.program.shards[key].layout
        if local is not None:
            with torch.no_grad():
                whole = plan_reshard(lay, Layout.replicated(lay.shape, lay.group)).apply(
                    local, self.unit_device, self._comm.groups)
        else:
            whole = torch.empty(lay.shape, dtype=dtype, device=self._device)
        self.share_in_unit(key, whole)  # held by some devices (a stage): they tell the rest
        return whole

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Each rank keeps its own pieces of a whole state dict (no communication)."""
        missing = [self.program.shards[v].fqn for v in self._held
                   if self.program.shards[v].in_state_dict and self.program.shards[v].fqn not in state]
        if missing:
            raise KeyError(f"state dict lacks {len(missing)} tensor(s) this plan needs: {missing[:8]}")
        with torch.no_grad():
            for v in self._held:
                s = self.program.shards[v]
                if s.kind == "constant" or s.fqn not in state:
                    continue
                full = state[s.fqn]
                if tuple(full.shape) != tuple(s.layout.shape):
                    raise ValueError(f"{s.fqn}: shape {tuple(full.shape)} in the state dict, model has {s.layout.shape}")
                local = s.layout.slice_full(full, self.unit_device)
                if self.zero3 is not None and s.fqn in self._zero3_key:
                    local = self.zero_shards[s.fqn].owned(local.reshape(-1))
                self.local_tensor(v).copy_(local)


def _keeps_as_is(full: Optional[torch.Tensor], kind: str, device: torch.device, dtype: torch.dtype,
                 chunked: bool) -> bool:
    """Whether the eager executor's shard of `full` (a whole parameter or buffer of the model) is the
    model's own tensor: not cut into a ZeRO-3 chunk, real, on this device, and (a floating-point
    parameter) in the dtype the plan computes in."""
    if full is None or full.is_meta or chunked or kind not in ("param", "buffer") or full.device != device:
        return False
    if kind == "param":
        return isinstance(full, torch.nn.Parameter) and (not full.is_floating_point() or full.dtype == dtype)
    return True


def _full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = p
    for n, b in model.named_buffers(remove_duplicate=False):
        out[n] = b
    return out
