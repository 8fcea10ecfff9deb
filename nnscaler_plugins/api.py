"""The user-facing entry points: capture a model, plan it, compile the plan, parallelize it on every
rank. Each is one `Session` (session.py), the object the framework adapters keep for a whole job."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.compiler import DEFAULT_CACHE_DIR, Compiled
from nnscaler_plugins.plan import fields
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.source import PlanLike
from nnscaler_plugins.plugins import strategies as registered_strategies
from nnscaler_plugins.runtime.parallel_module import ParallelModule
from nnscaler_plugins.session import Session, capture

__all__ = ["capture", "plan", "compile", "parallelize", "strategies", "Session", "graph_of"]


def plan(model_or_graph: Any, *, strategy: PlanLike = "tp", world_size: int, example_inputs: Any = None,
         cluster: Any = None, constraints: tuple = (), **options: Any) -> Plan:
    """Make a validated Plan by a strategy name, a callable `fn(builder, **options)`, a Plan or a plan file.

    `example_inputs` is what one data-parallel replica's forward takes in one training step; with
    `micro_batches=` (or `micro_batch_size=`) the step is cut into micro-batches along the batch
    dim and the plan is made for one of them. `cluster` and `constraints` are for strategies that
    plan for a cluster ("auto" searches on it).
    """
    fields.world_size(world_size, required=True)
    session = Session(strategy, **options)
    extra: dict[str, Any] = {}
    if cluster is not None:
        extra["cluster"] = cluster
    if constraints:
        extra["constraints"] = tuple(constraints)
    return session.plan_for(model_or_graph, example_inputs, world_size, extra=extra)


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
    fields.world_size(world_size)
    session = Session(plan, **options)
    if world_size is None:
        world_size = session.source.plan.world_size if session.source.plan is not None else 1
    return session.compile(model, example_inputs, world_size, cache_dir)


def parallelize(model: torch.nn.Module, example_inputs: Any, *, plan: PlanLike = "tp",
                world_size: Optional[int] = None, device: Optional[Union[str, torch.device]] = None,
                cache_dir: str = DEFAULT_CACHE_DIR, loss_fn: Optional[Callable] = None,
                init_seed: Optional[int] = None, **options: Any) -> ParallelModule:
    """Capture, plan, compile and run: this rank's ParallelModule.

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
    fields.world_size(world_size)
    session = Session(plan, **options)  # before the process group, the capture or the cache is touched
    return session.parallelize(model, example_inputs, world_size=world_size, device=device, cache_dir=cache_dir,
                               loss_fn=loss_fn, init_seed=init_seed)


def strategies() -> list[str]:
    """Names of all registered strategies."""
    return registered_strategies()


def graph_of(model_or_graph: Any, example_inputs: Any, plan: PlanLike = "tp", **options: Any) -> Graph:
    """The graph `nns.plan` / `nns.parallelize` would capture for this plan and options (one
    micro-batch of the example; mixture-of-experts layers as one op where the plan wants them)."""
    return Session(plan, **options).capture(model_or_graph, example_inputs)
