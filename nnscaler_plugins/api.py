"""The user-facing entry points: plan a model, and parallelize it on every rank."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler_plugins.capture.experts import experts_as_one_op, wants_experts_as_one_op
from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.batches import normalize_inputs, resolve_micro_batches, split_batch
from nnscaler_plugins.capture import tracing
from nnscaler_plugins.compiler import DEFAULT_CACHE_DIR, Compiled, compile_program
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.lowering import Program, lower
from nnscaler_plugins.passes.batch_statistics import with_batch_statistics
from nnscaler_plugins.plan.knobs import KNOB_OPTIONS, Knobs
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.primitives import PlanBuilder
from nnscaler_plugins.plan.source import PlanLike, PlanSource, resolve
from nnscaler_plugins.plan.validate import validate
from nnscaler_plugins.plugins import get_plugin_manager
from nnscaler_plugins.rules.table import warn_replicate_only


def capture(model: torch.nn.Module, args: Any = (), kwargs: Optional[dict] = None, *,
            trace_repeated_layers_once: bool = True) -> Graph:
    """Capture `model(*args, **kwargs)` as a `Graph` (see `capture.tracing.capture`), then warn once,
    listing every op no dimension rule covers (plans can only replicate those) with its source line."""
    graph = tracing.capture(model, args, kwargs, trace_repeated_layers_once=trace_repeated_layers_once)
    warn_replicate_only(graph)
    return graph


def _graph_of(model_or_graph: Any, example_inputs: Any, micro_batches: int = 1, whole_experts: bool = False) -> Graph:
    """The graph of one micro-batch: a model is captured on the first micro-batch of its inputs
    (with `whole_experts`, each mixture-of-experts layer as one op, see capture/experts.py)."""
    if isinstance(model_or_graph, Graph):
        return model_or_graph
    if example_inputs is None:
        raise TypeError("planning a model needs example_inputs= (what its forward takes)")
    first = split_batch(example_inputs, micro_batches)[0] if micro_batches > 1 else example_inputs
    args, kwargs = normalize_inputs(first, None)
    if _on_meta(model_or_graph):  # inputs beside meta weights: an op mixing devices would refuse to trace
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with experts_as_one_op(model_or_graph) if whole_experts else contextlib.nullcontext():
        return capture(model_or_graph, args, kwargs)


def _on_meta(model: Any) -> bool:
    from nnscaler_plugins.runtime.materialize import has_meta_tensors

    return isinstance(model, torch.nn.Module) and has_meta_tensors(model)


def plan(model_or_graph: Any, *, strategy: PlanLike = "tp", world_size: int, example_inputs: Any = None,
         cluster: Any = None, constraints: tuple = (), **options: Any) -> Plan:
    """Make a validated Plan by a strategy name, a callable `fn(builder, **options)`, a Plan or a plan file.

    `example_inputs` is what one data-parallel replica's forward takes in one training step; with
    `micro_batches=` (or `micro_batch_size=`) the step is cut into micro-batches along the batch
    dim and the plan is made for one of them.
    """
    source = resolve(strategy)
    source.check_options(options)  # a misspelt option is refused before the model is captured
    micro = resolve_micro_batches(None if isinstance(model_or_graph, Graph) else example_inputs,
                                  options.pop("micro_batches", None), options.pop("micro_batch_size", None))
    graph = _graph_of(model_or_graph, example_inputs, micro, wants_experts_as_one_op(source.fn or source.plan))
    if cluster is not None:  # for strategies that plan for a cluster ("auto" searches on it)
        options.setdefault("cluster", cluster)
    if constraints:
        options.setdefault("constraints", tuple(constraints))
    made, _ = _plan_and_program(graph, source, world_size, micro, options,
                                lower_now=lambda p: p.unit_size <= _LOWER_CHECK_MAX_UNIT)
    return made


def _plan_and_program(graph: Graph, source: PlanSource, world_size: int, micro: int, options: dict,
                      lower_now: Callable[[Plan], bool]) -> tuple[Plan, Optional[Program]]:
    """The validated plan for `graph`, and its Program when `lower_now(plan)` says to lower it here
    (cross-device problems surface at once; `parallelize` keeps what was lowered)."""
    # Training knobs every strategy takes: set on the plan, not handed to the strategy function.
    zero, precision = options.pop("zero", None), options.pop("precision", None)
    offload = options.pop("offload", None)
    knobs = {k: options.pop(k) for k in KNOB_OPTIONS if k in options}
    if source.plan is not None:
        p = with_batch_statistics(source.plan, graph)  # a searched or saved plan that does not say
    else:
        builder = PlanBuilder(graph, mesh=source.mesh(world_size, options), strategy=source.name,
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
    p.check_runnable()
    validate(p, graph, world_size=world_size)
    return p, (lower(graph, p) if lower_now(p) else None)


# Lowering writes statements for every device of the unit; past this size (plans for large
# clusters, made to be simulated) the check is left to `parallelize`, which lowers anyway.
_LOWER_CHECK_MAX_UNIT = 64


def _default_device() -> torch.device:
    """This rank's GPU when there is one (LOCAL_RANK from the launcher picks it), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _init_distributed(device: torch.device) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = get_plugin_manager().hook.nnscaler_choose_backend(device_type=device.type)
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def compile(model: Any, example_inputs: Any = None, plan: PlanLike = "tp", *, world_size: Optional[int] = None,
            cache_dir: str = DEFAULT_CACHE_DIR, **options: Any) -> Compiled:
    """The compile stage on its own: capture `model` (or take a Graph), make the plan (a strategy name,
    a function, a Plan or a plan file, with `options`), lower it and return the `Compiled` plan whose
    `artifact(device)` / `artifact_for_rank(rank)` is what each rank runs: its generated module, its
    shard and group specs, and the callback that serves inputs of other sizes. No process group is
    needed; `world_size` defaults to the plan's (a ready plan) or 1.

        compiled = nns.compile(model, batch, "tp", world_size=4)
        print(compiled.artifact(0).source())   # the code device 0 runs
    """
    source = resolve(plan)
    source.check_options(options)
    if world_size is None:
        world_size = source.plan.world_size if source.plan is not None else 1
    if source.plan is not None:
        micro = source.plan.num_micro_batches
        if not isinstance(model, Graph):
            resolve_micro_batches(example_inputs, micro)
    else:
        micro = resolve_micro_batches(None if isinstance(model, Graph) else example_inputs,
                                      options.pop("micro_batches", None), options.pop("micro_batch_size", None))
    graph = _graph_of(model, example_inputs, micro, wants_experts_as_one_op(source.fn or source.plan))
    made, program = _plan_and_program(graph, source, world_size, micro, options, lower_now=lambda p: True)
    return compile_program(graph, made, model=None if isinstance(model, Graph) else model, program=program,
                           cache_dir=cache_dir)


def parallelize(model: torch.nn.Module, example_inputs: Any, *, plan: PlanLike = "tp",
                world_size: Optional[int] = None, device: Optional[Union[str, torch.device]] = None,
                cache_dir: str = DEFAULT_CACHE_DIR, loss_fn: Optional[Callable] = None,
                init_seed: Optional[int] = None, **options: Any):
    """Capture, plan, lower and generate code for this rank; returns its ParallelModule.

    Call on every rank with the same model (same initial weights) and example inputs. Initializes
    torch.distributed from the launcher's environment when it is not initialized yet; the backend
    comes from the `nnscaler_choose_backend` hook (NCCL for CUDA, gloo for CPU by default).

    A model built on the meta device (`with torch.device("meta")`, HF `from_config` under it,
    accelerate's `init_empty_weights`) is never made whole: each rank initializes only the tensors
    it holds pieces of, module by module, by the model's own initialization, each module seeded
    from `init_seed` and its name (runtime/materialize.py), so the weights are the same under any
    plan and equal `nns.init_weights(model, init_seed)` in one process. `init_seed` defaults to
    rank 0's `torch.initial_seed()`.
    """
    from nnscaler_plugins.runtime.materialize import has_meta_tensors
    from nnscaler_plugins.runtime.parallel_module import ParallelModule

    source = resolve(plan)
    source.check_options(options)  # before the process group, the capture or the cache is touched
    dev = torch.device(device) if device is not None else _default_device()
    rank, ws = _init_distributed(dev)
    world_size = world_size or ws
    if world_size != ws:
        raise PlanError(f"world_size={world_size} but the process group has {ws} processes")
    if source.plan is not None:
        micro = source.plan.num_micro_batches
        resolve_micro_batches(example_inputs, micro)  # the batch must cut into the plan's micro-batches
    else:
        micro = resolve_micro_batches(example_inputs, options.pop("micro_batches", None),
                                      options.pop("micro_batch_size", None))
    graph = _capture_on_every_rank(model, example_inputs, micro, rank, world_size,
                                   wants_experts_as_one_op(source.fn or source.plan))
    made, program = _plan_and_program(graph, source, world_size, micro, options, lower_now=lambda p: True)
    compiled = compile_program(graph, made, model=model, program=program, cache_dir=cache_dir)
    seed = _agreed_init_seed(init_seed, dev, world_size) if has_meta_tensors(model) else None
    return ParallelModule(compiled.artifact_for_rank(rank), model, rank=rank, world_size=world_size, device=dev,
                          loss_fn=loss_fn, init_seed=seed)


def _agreed_init_seed(init_seed: Optional[int], device: torch.device, world_size: int) -> int:
    """The base seed of a meta model's initialization: `init_seed`, else rank 0's
    `torch.initial_seed()`, the same on every rank (processes seeded differently still agree)."""
    seed = torch.initial_seed() if init_seed is None else int(init_seed)
    if world_size > 1:
        t = torch.tensor([seed & (2**63 - 1)], dtype=torch.int64, device=device if device.type != "meta" else "cpu")
        dist.broadcast(t, src=0)
        seed = int(t.item())
    return seed


# After a capture error, how long a rank other than 0 waits for the launcher to stop it (torchrun,
# torch.multiprocessing and the Lightning strategy stop the others once rank 0 has failed) before it
# raises a one-line error of its own: the job shows the message once, from rank 0.
QUIET_RANK_WAIT_S = 60.0


def _capture_on_every_rank(model: Any, example_inputs: Any, micro: int, rank: int, world_size: int,
                           whole_experts: bool = False) -> Graph:
    """The graph every rank captures (same model, same shapes, so a CaptureError happens on all of
    them); rank 0 raises it, the others stay quiet, then raise one line naming rank 0."""
    from nnscaler_plugins.capture.tracing import CaptureError

    try:
        return _graph_of(model, example_inputs, micro, whole_experts)
    except CaptureError as e:
        if rank == 0 or world_size == 1:
            raise
        time.sleep(QUIET_RANK_WAIT_S)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"rank {rank}: {first} (rank 0 reports the whole error)") from None


def strategies() -> list[str]:
    """Names of all registered strategies."""
    from nnscaler_plugins.plugins import strategies as _s
    return _s()
