"""One job's way through the stages: the plan resolved once, the model captured once, then planned,
compiled and run.

    session = Session("tp", tp=2, where="NNScalerStrategy(plan=...)")   # checks the plan and options now
    graph = session.capture(model, batch)                                  # once (again only for a new model)
    module = session.parallelize(model, batch, device=device)             # plan, compile, run on this rank

`nns.plan`, `nns.compile` and `nns.parallelize` are a Session each; the Lightning strategy, the
Hugging Face Trainer and the DeepSpeed engine keep one per job, so a misspelt option is refused where
the user wrote it (before any process starts) and the micro-batches are resolved in one place.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler_plugins.batches import normalize_inputs, resolve_micro_batches, split_batch
from nnscaler_plugins.capture import tracing
from nnscaler_plugins.capture.experts import experts_as_one_op, wants_experts_as_one_op
from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.capture.parameters import parameter_graph
from nnscaler_plugins.compiler.artifact import Artifact
from nnscaler_plugins.compiler.eager import eager_artifact
from nnscaler_plugins.compiler import DEFAULT_CACHE_DIR, Compiled, compile_program
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.eager import runs_eagerly
from nnscaler_plugins.lower.lowering import Program, lower
from nnscaler_plugins.passes.batch_statistics import with_batch_statistics
from nnscaler_plugins.plan.knobs import KNOB_OPTIONS, Knobs
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.primitives import PlanBuilder
from nnscaler_plugins.plan.source import PlanLike, PlanSource, resolve
from nnscaler_plugins.plan.validate import made_for, validate
from nnscaler_plugins.plugins import get_plugin_manager
from nnscaler_plugins.rules.table import warn_replicate_only
from nnscaler_plugins.runtime.job_store import init_default_group, launcher_advice
from nnscaler_plugins.runtime.materialize import has_meta_tensors
from nnscaler_plugins.runtime.parallel_module import ParallelModule

#: Lowering writes statements for every device of the unit; past this size (plans for large clusters,
#: made to be simulated) `Session.plan` leaves the check to `parallelize`, which lowers anyway.
LOWER_CHECK_MAX_UNIT = 64

#: After a capture error, how long a rank other than 0 waits for the launcher to stop it (torchrun,
#: torch.multiprocessing and the Lightning strategy stop the others once rank 0 has failed) before it
#: raises a one-line error of its own: the job shows the message once, from rank 0.
QUIET_RANK_WAIT_S = 60.0


def capture(model: torch.nn.Module, args: Any = (), kwargs: Optional[dict] = None, *,
            trace_repeated_layers_once: bool = True) -> Graph:
    """Capture `model(*args, **kwargs)` as a `Graph` (see `capture.tracing.capture`), then warn once,
    listing every op no dimension rule covers (plans can only replicate those) with its source line."""
    graph = tracing.capture(model, args, kwargs, trace_repeated_layers_once=trace_repeated_layers_once)
    warn_replicate_only(graph)
    return graph


class Session:
    """A plan-like value (strategy name, function, Plan, plan file) with its options, checked at once,
    and what was made from it: the graph, the plan, the compiled artifacts."""

    def __init__(self, plan: PlanLike = "tp", *, where: str = "", **options: Any):
        self.source: PlanSource = resolve(plan, where)
        self.source.check_options(options, where)  # a misspelt option, before anything is captured
        self.where = where
        self.options = dict(options)
        self.graph: Optional[Graph] = None
        self.plan: Optional[Plan] = None
        self.program: Optional[Program] = None
        self.compiled: Optional[Compiled] = None
        self._captured: Optional[tuple[int, Any]] = None  # (id of the model, the example's shapes)
        # Devices per node, when a launcher says (LOCAL_WORLD_SIZE; `parallelize` reads it): the plan's mesh
        # and the search's cluster know which ranks share a node.
        self.devices_per_node: Optional[int] = None

    # -- micro-batches: one place --------------------------------------------------------------------------
    def micro_batches(self, example_inputs: Any) -> int:
        """Micro-batches per step: a ready plan's own (the example must cut into them), else from
        `micro_batches=` / `micro_batch_size=` against the example."""
        if self.source.plan is not None:
            micro = self.source.plan.num_micro_batches
            if example_inputs is not None:
                resolve_micro_batches(example_inputs, micro)
            return micro
        return resolve_micro_batches(example_inputs, self.options.get("micro_batches"),
                                     self.options.get("micro_batch_size"))

    # -- capture: once -------------------------------------------------------------------------------------
    def capture(self, model: Any, example_inputs: Any) -> Graph:
        """The graph of one micro-batch of `example_inputs` (a Graph is taken as it is); captured once
        per model and example shapes, each mixture-of-experts layer as one op where the plan wants it."""
        if isinstance(model, Graph):
            self.graph = model
            return model
        if example_inputs is None:
            raise TypeError("planning a model needs example_inputs= (what its forward takes)")
        key = (id(model), _shapes_of(example_inputs))
        if self.graph is not None and self._captured == key:
            return self.graph
        self.graph = self._trace(model, example_inputs)
        ready = self.source.plan
        if ready is not None and self.graph.traced and not made_for(ready, self.graph):
            # A stack of layers traced two deep and copied, or whole where tracing two failed:
            # the same program under other op names. The ready plan was made from a capture that
            # went the other way (another process, another torch): trace this one that way too.
            other = self._trace(model, example_inputs, two_layers=self.graph.traced != "two layers")
            if made_for(ready, other):
                self.graph = other
        self._captured = key
        return self.graph

    def _trace(self, model: Any, example_inputs: Any, two_layers: bool = True) -> Graph:
        """One capture of one micro-batch of `example_inputs` (a stack of repeated layers traced two
        deep and copied when `two_layers`, else whole), mixture-of-experts layers as one op where the
        plan wants them."""
        micro = self.micro_batches(example_inputs)
        first = split_batch(example_inputs, micro)[0] if micro > 1 else example_inputs
        args, kwargs = normalize_inputs(first, None)
        if has_meta_tensors(model):  # inputs beside meta weights: an op mixing devices would refuse to trace
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        whole_experts = wants_experts_as_one_op(self.source.fn or self.source.plan, self.options)
        with experts_as_one_op(model) if whole_experts else contextlib.nullcontext():
            return capture(model, args, kwargs, trace_repeated_layers_once=two_layers)

    def capture_on_every_rank(self, model: Any, example_inputs: Any, rank: int, world_size: int) -> Graph:
        """`capture` on every rank (same model, same shapes, so a CaptureError happens on all of them):
        rank 0 raises it, the others stay quiet, then raise one line naming rank 0."""
        try:
            graph = self.capture(model, example_inputs)
        except tracing.CaptureError as e:
            if rank == 0 or world_size == 1:
                raise
            time.sleep(QUIET_RANK_WAIT_S)
            said = first_lines(e)  # what failed, and the reason's first line
            raise tracing.CaptureError(f"rank {rank}: {said} (rank 0 reports the whole error)") from None
        if world_size > 1 and not isinstance(model, Graph) and dist.is_available() and dist.is_initialized():
            graph = self._agree_on_capture(model, example_inputs, rank, world_size)
        return graph

    def _agree_on_capture(self, model: Any, example_inputs: Any, rank: int, world_size: int) -> Graph:
        """Every rank runs the program its own capture gave, so the captures must agree. A stack of
        layers is traced two deep and copied where that traces as one program, else whole, and
        processes can differ there (one hit an error in the two-layer trace that another did not):
        the same computation under other op names, hence other plans. A rank that went the other way
        from rank 0 traces again rank 0's way; ranks whose programs still differ from rank 0's are
        named, with how each traced its layers, before any plan is made. Sizes that follow the inputs
        may differ (each rank's example batch), as the runtime fits them."""
        def everyone() -> list[tuple[str, str]]:
            out: list[Any] = [None] * world_size
            dist.all_gather_object(out, (self.graph.structure_fingerprint(), self.graph.traced))
            return out

        seen = everyone()
        lead = seen[0]
        if all(s[0] == lead[0] for s in seen):
            return self.graph
        if seen[rank][0] != lead[0] and self.graph.traced and lead[1] and self.graph.traced != lead[1]:
            other = self._trace(model, example_inputs, two_layers=lead[1] == "two layers")
            if other.structure_fingerprint() == lead[0]:
                self.graph = other
        seen = everyone()
        differ = [r for r, s in enumerate(seen) if s[0] != seen[0][0]]
        if differ:
            how = "; ".join(f"rank {r}: program {s[0]}, layers traced {s[1] or 'as they are (no repeated stack)'}"
                            for r, s in enumerate(seen) if r == 0 or r in differ)
            raise PlanError(f"the ranks captured different programs from the model ({how}); every rank must "
                            "capture the same model with example inputs of the same structure. Look for code "
                            "that depends on the rank or on the values of the batch.")
        return self.graph

    # -- plan --------------------------------------------------------------------------------------------
    def make_plan(self, graph: Graph, world_size: int, micro: int, lower_now: bool = True,
                  extra: Optional[Mapping[str, Any]] = None) -> Plan:
        """The validated plan for `graph` on `world_size` devices (lowered here too when `lower_now`,
        so cross-device problems surface at once; `compile` keeps what was lowered)."""
        options = {k: v for k, v in self.options.items() if k not in ("micro_batches", "micro_batch_size")}
        for k, v in (extra or {}).items():
            options.setdefault(k, v)
        zero, precision = options.pop("zero", None), options.pop("precision", None)
        offload = options.pop("offload", None)
        knobs = {k: options.pop(k) for k in KNOB_OPTIONS if k in options}
        source = self.source
        if source.plan is not None:
            p = with_batch_statistics(source.plan, graph)  # a searched or saved plan that does not say
        else:
            builder = PlanBuilder(graph, mesh=source.mesh(world_size, options).with_nodes(self.devices_per_node),
                                  strategy=source.name,
                                  options={k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))},
                                  micro_batches=micro, zero=0 if zero is None else zero,
                                  precision="fp32" if precision is None else precision,
                                  knobs=Knobs().replace(**knobs))
            source.call(builder, options)
            p = with_batch_statistics(builder.finish(validate=False), graph, builder)  # any strategy's replicas
        if (zero is not None and zero != p.zero) or (precision is not None and precision != p.precision):
            p = dataclasses.replace(p, zero=p.zero if zero is None else zero,
                                    precision=p.precision if precision is None else precision)
        if offload is not None and offload != p.offload:
            p = dataclasses.replace(p, offload=offload)
        if knobs and any(getattr(p.knobs, k) != v for k, v in knobs.items()):
            p = dataclasses.replace(p, knobs=p.knobs.replace(**knobs))
        if self.devices_per_node and p.mesh.devices_per_node != self.devices_per_node:
            p = dataclasses.replace(p, mesh=p.mesh.with_nodes(self.devices_per_node))
        warn_axes_across_nodes(p.mesh)
        p.check_runnable()
        validate(p, graph, world_size=world_size)
        self.plan, self.program = p, (lower(graph, p) if lower_now else None)
        return p

    def plan_for(self, model: Any, example_inputs: Any, world_size: int, lower_now: Optional[bool] = None,
                 extra: Optional[Mapping[str, Any]] = None) -> Plan:
        """Capture (once) and plan; lowered here when the unit is small enough to check at once. A model
        capture cannot take gets the plan that runs its own forward where the plan allows (see
        `capture_or_eager`), else the capture's error naming the plans that do run it."""
        if self.executor == "eager":
            return self.eager_plan(model, example_inputs, world_size, self._eager_reason_asked(world_size))
        try:
            graph = self.capture(model, example_inputs)
        except tracing.CaptureError as e:
            if self.executor == "captured" or isinstance(model, Graph):
                raise
            if not self.can_run_eagerly(world_size):
                raise self.with_eager_plans(e) from e
            return self.eager_plan(model, example_inputs, world_size, f"capture failed ({first_lines(e)})")
        micro = self.micro_batches(None if isinstance(model, Graph) else example_inputs)
        plan = self.make_plan(graph, world_size, micro, lower_now=False, extra=extra)
        if lower_now if lower_now is not None else plan.unit_size <= LOWER_CHECK_MAX_UNIT:
            self.program = lower(graph, plan)
        return plan

    # -- compile -----------------------------------------------------------------------------------------
    def compile(self, model: Any, example_inputs: Any, world_size: int,
                cache_dir: str = DEFAULT_CACHE_DIR) -> Compiled:
        """Capture (once), plan and lower for the whole unit; the `Compiled` plan's artifacts are what
        each rank runs."""
        if self.plan is None or self.program is None or self.plan.world_size != world_size:
            self.plan_for(model, example_inputs, world_size, lower_now=True)
        if self.plan.knobs.executor == "eager":
            raise PlanError(f"the model's plan runs its own forward eagerly ({self.plan.knobs.eager_reason}): "
                            "there is no generated code to compile; nns.parallelize(model, batch, plan=...) runs it")
        assert self.graph is not None and self.plan is not None and self.program is not None
        self.compiled = compile_program(self.graph, self.plan, model=None if isinstance(model, Graph) else model,
                                        program=self.program, cache_dir=cache_dir)
        return self.compiled

    # -- run -----------------------------------------------------------------------------------------------
    def parallelize(self, model: torch.nn.Module, example_inputs: Any, *, world_size: Optional[int] = None,
                    device: Optional[Union[str, torch.device]] = None, cache_dir: str = DEFAULT_CACHE_DIR,
                    loss_fn: Optional[Callable] = None, init_seed: Optional[int] = None) -> ParallelModule:
        """This rank's ParallelModule: torch.distributed initialized from the launcher's environment
        when it is not yet (the backend from the `nnscaler_choose_backend` hook), the model captured
        on every rank, planned, compiled, and its artifact run (see `nns.parallelize`)."""
        dev = torch.device(device) if device is not None else default_device()
        rank, ws = init_distributed(dev)
        self.devices_per_node = launcher_devices_per_node(ws)
        world_size = world_size or ws
        if world_size != ws:
            raise PlanError(f"world_size={world_size} but the process group has {ws} processes")
        self.micro_batches(example_inputs)  # the batch must cut into the plan's micro-batches, before capture
        eager_reason = self.capture_or_eager(model, example_inputs, rank, world_size)
        if eager_reason is not None:
            artifact = self.eager_artifact(model, example_inputs, world_size, eager_reason)
        else:
            self.plan_for(model, example_inputs, world_size, lower_now=True)
            artifact = self.compile(model, example_inputs, world_size, cache_dir).artifact_for_rank(rank)
        seed = agreed_init_seed(init_seed, dev, world_size) if has_meta_tensors(model) else None
        return ParallelModule(artifact, model, rank=rank, world_size=world_size, device=dev,
                              loss_fn=loss_fn, init_seed=seed)

    # -- the eager executor: the model's own forward where capture cannot take it ---------------------------
    @property
    def executor(self) -> str:
        """"auto", "captured" or "eager" (the `executor=` option, else a ready plan's knob)."""
        if "executor" in self.options:
            return str(self.options["executor"])
        return self.source.plan.knobs.executor if self.source.plan is not None else "auto"

    def can_run_eagerly(self, world_size: int) -> bool:
        """Whether this plan keeps whole layers on each device (one per replica, no pipeline), so the
        model's own forward can run on every replica: dp, zero1-3, offload."""
        if self.source.plan is not None:
            return runs_eagerly(self.source.plan)
        if self.source.fn is None:
            return False
        try:
            mesh = self.source.mesh(world_size, self.options)
        except (PlanError, TypeError, ValueError):
            return False
        return mesh.unit_size == 1

    def capture_or_eager(self, model: Any, example_inputs: Any, rank: int, world_size: int) -> Optional[str]:
        """Capture on every rank (`capture_on_every_rank`) and return None; or, where the plan can run
        the model's own forward and capture fails on some rank (or `executor="eager"`), return why the
        eager executor runs instead, the same on every rank. A plan that must split ops re-raises the
        capture's error, with the plans that do run the model named."""
        executor = self.executor
        if executor == "eager":
            return self._eager_reason_asked(world_size)
        if executor == "captured" or not self.can_run_eagerly(world_size) or isinstance(model, Graph):
            try:
                self.capture_on_every_rank(model, example_inputs, rank, world_size)
            except tracing.CaptureError as e:
                if executor == "captured" or rank != 0 and world_size > 1:
                    raise
                raise self.with_eager_plans(e) from None  # one report: it carries e's message and details
            return None
        failed: Optional[str] = None
        try:
            self.capture(model, example_inputs)
        except tracing.CaptureError as e:
            failed = first_lines(e)
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            said: list[Any] = [None] * world_size
            dist.all_gather_object(said, failed)
            first = next((r for r, f in enumerate(said) if f is not None), None)
            if first is None:
                self._agree_on_capture(model, example_inputs, rank, world_size)
                return None
            failed = said[first] if world_size == 1 or first == 0 else f"on rank {first}: {said[first]}"
        if failed is None:
            return None
        self.graph = None
        return f"capture failed ({failed})"

    def _eager_reason_asked(self, world_size: int) -> str:
        if not self.can_run_eagerly(world_size):
            raise PlanError(f"executor='eager' runs the model's own forward on every replica, but "
                            f"{self.source.label} splits the model across devices; use a plan with one device "
                            "per replica (dp, zero1, zero2, zero3), or executor='auto'")
        return "executor='eager' was asked for"

    @staticmethod
    def with_eager_plans(e: tracing.CaptureError) -> tracing.CaptureError:
        """The capture's error, saying which plans run the model without capturing it."""
        out = type(e)(f"{e}\n  Plans that keep whole layers on each device run this model as it is, with its "
                      "own forward (the eager executor): plan='dp', 'zero1', 'zero2' or 'zero3'.")
        out.details = e.details
        return out

    def eager_plan(self, model: torch.nn.Module, example_inputs: Any, world_size: int, reason: str) -> Plan:
        """The plan over the model's parameters alone (`capture/parameters.py`), marked to run eagerly."""
        graph = parameter_graph(model)
        ready = self.source.plan
        if ready is not None:
            p = dataclasses.replace(ready, ops={}, graph_fingerprint=graph.fingerprint(),
                                    structure_fingerprint=graph.structure_fingerprint(), model_class=graph.model_class,
                                    input_shapes={})
        else:
            p = self.make_plan(graph, world_size, self.micro_batches(example_inputs), lower_now=False)
        p = dataclasses.replace(p, knobs=p.knobs.replace(executor="eager", eager_reason=reason), graph=graph)
        self.graph, self.plan, self.program = graph, p, None
        return p

    def eager_artifact(self, model: torch.nn.Module, example_inputs: Any, world_size: int, reason: str) -> Artifact:
        """This rank's artifact of the eager plan (every rank runs device 0 of a one-device unit)."""
        plan = self.eager_plan(model, example_inputs, world_size, reason)
        if plan.num_micro_batches < 1 or not runs_eagerly(plan):
            raise PlanError(f"{self.source.label}: the plan made for the eager executor splits the model "
                            f"({plan.mesh.describe()}); use dp, zero1, zero2 or zero3")
        artifact = eager_artifact(self.graph, plan)
        self.program = artifact.program
        return artifact


def first_lines(e: BaseException) -> str:
    """An error's first two lines, joined: what failed and why, for a plan's reason or another rank."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__


def _shapes_of(example: Any) -> Any:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in pytree.tree_leaves(example))


def default_device() -> torch.device:
    """This rank's GPU when there is one (LOCAL_RANK from the launcher picks it), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size), initializing torch.distributed from the launcher's environment when it is
    set and the process group is not made yet; (0, 1) without a launcher."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = get_plugin_manager().hook.nnscaler_choose_backend(device_type=device.type)
        init_default_group(backend)  # on a store view of this restart attempt (runtime/job_store.py)
        advice = launcher_advice(os.environ)
        if advice and dist.get_rank() == 0:
            warnings.warn(advice, stacklevel=3)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launcher_devices_per_node(world_size: int) -> Optional[int]:
    """Processes per node as the launcher started them (torchrun's LOCAL_WORLD_SIZE), when they fill
    whole nodes; None otherwise (one node, or no launcher that says)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local or not local.isdigit():
        return None
    n = int(local)
    return n if 0 < n < world_size and world_size % n == 0 else None


def warn_axes_across_nodes(mesh: Any) -> None:
    """Tensor and context parallelism communicate in every layer: say so when their groups span nodes."""
    inner = tuple(a for a in ("tp", "cp") if a in mesh.names and mesh[a] > 1)
    if inner and mesh.within_node(inner) is False:
        warnings.warn(f"the plan's {' x '.join(f'{a} {mesh[a]}' for a in inner)} groups span nodes of "
                      f"{mesh.devices_per_node} devices: their collectives cross the network every layer; choose "
                      f"degrees up to {mesh.devices_per_node} (data parallelism goes across nodes)", stacklevel=3)


def agreed_init_seed(init_seed: Optional[int], device: torch.device, world_size: int) -> int:
    """The base seed of a meta model's initialization: `init_seed`, else rank 0's
    `torch.initial_seed()`, the same on every rank (processes seeded differently still agree)."""
    seed = torch.initial_seed() if init_seed is None else int(init_seed)
    if world_size > 1:
        t = torch.tensor([seed & (2**63 - 1)], dtype=torch.int64, device=device if device.type != "meta" else "cpu")
        dist.broadcast(t, src=0)
        seed = int(t.item())
    return seed
