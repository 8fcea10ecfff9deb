"""`nnscaler-plan`: search, look at, price and draw plans from the shell.

    nnscaler-plan search gpt2-xl/config.json --world-size 64 --cluster a100-dgx --global-batch 512 \\
                         --seq 1024 --constraint max-tp --constraint memory=40GiB --out plans/
    nnscaler-plan search mypkg.models:build --world-size 8 --cluster my-cluster.yaml
    nnscaler-plan explain plans/plan_0.json
    nnscaler-plan simulate plans/plan_0.json --model gpt2-xl/config.json --cluster a100-dgx
    nnscaler-plan show plans/plan_0.json [--model MODEL --rank 3]     # the JSON summary, or rank 3's code
    nnscaler-plan render plans/plan_0.json --model MODEL --cluster a100-dgx --out pictures/
    nnscaler-plan strategies

A model is a Hugging Face config file (or a directory holding config.json), built on the meta
device with `--micro-batch` sequences of `--seq` tokens, or `module:factory` (a module name or a .py
file), where factory() returns (model, example_inputs) for one micro-batch. Constraints:
max-tp[=N], pp=1,2,4, schedule=1f1b,interleaved, micro-batch=1,2, memory=40GiB, zero=0,1,
recompute=none,full, replicated=MODULE, not-split=MODULE:DIM, same-layers, hf-tp-plan[=require].
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.plan import Plan

CONSTRAINT_FORMS = ("max-tp[=N]", "pp=1,2,4", "schedule=1f1b,interleaved", "micro-batch=1,2", "memory=40GiB",
                    "zero=0,1", "recompute=none,full", "replicated=MODULE", "not-split=MODULE:DIM", "same-layers",
                    "hf-tp-plan[=require]")


class UsageError(ValueError):
    """Bad command-line input; printed without a traceback."""


# -- models --------------------------------------------------------------------------------------------------
def load_model(spec: str, micro_batch: int = 1, seq: int = 1024) -> tuple[Any, Any]:
    """(model, example inputs of one micro-batch) from a config file/dir or `module:factory`."""
    path = spec
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "config.json")):
        path = os.path.join(spec, "config.json")
    if path.endswith(".json") or os.path.basename(path) == "config.json":
        if not os.path.exists(path):
            raise UsageError(f"model config {path} does not exist")
        return _hf_model(path, micro_batch, seq)
    if ":" in spec:
        mod_name, _, fn_name = spec.rpartition(":")
        if mod_name.endswith(".py"):
            if not os.path.exists(mod_name):
                raise UsageError(f"model file {mod_name} does not exist")
            mspec = importlib.util.spec_from_file_location("_nnscaler_model", mod_name)
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(mod_name)
            except ImportError as e:
                raise UsageError(f"cannot import {mod_name!r} for the model: {e}") from None
        fn = getattr(module, fn_name, None)
        if fn is None:
            raise UsageError(f"{mod_name} has no {fn_name!r}")
        out = fn()
        if not (isinstance(out, tuple) and len(out) == 2):
            raise UsageError(f"{spec} must return (model, example_inputs) for one micro-batch")
        return out
    raise UsageError(f"cannot read the model {spec!r}: give a Hugging Face config.json (or its directory) or "
                     "module:factory returning (model, example_inputs)")


def _hf_model(path: str, micro_batch: int, seq: int) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    try:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        ids = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids}
    except ValueError:
        from transformers import AutoModelForImageClassification
        with torch.device("meta"):
            model = AutoModelForImageClassification.from_config(cfg)
        size = getattr(cfg, "image_size", 224)
        return model, {"pixel_values": torch.zeros(micro_batch, getattr(cfg, "num_channels", 3), size, size,
                                                   device="meta"),
                       "labels": torch.zeros(micro_batch, dtype=torch.long, device="meta")}


def _graph(spec: str, micro_batch: int, seq: int, plan: Optional[Plan] = None):
    from nnscaler_plugins.capture.tracing import capture, normalize_inputs

    if plan is not None and plan.input_shapes:
        shape = next(iter(plan.input_shapes.values()))
        if len(shape) >= 1:
            micro_batch = int(shape[0])
        if len(shape) == 2:
            seq = int(shape[1])
    model, inputs = load_model(spec, micro_batch, seq)
    args, kwargs = normalize_inputs(inputs, None)
    return capture(model, args, kwargs), model


# -- constraints ---------------------------------------------------------------------------------------------
def parse_constraint(text: str, model: Any = None):
    from nnscaler_plugins.search import constraints as C

    key, _, value = text.partition("=")
    key = key.strip().lower()
    values = [v.strip() for v in value.split(",") if v.strip()]
    try:
        if key in ("max-tp", "tp<"):
            return C.MaxTensorParallel(int(value) if value else None)
        if key == "pp":
            return C.PipelineStages(int(v) for v in values)
        if key in ("schedule", "schedules"):
            return C.Schedules(values)
        if key == "micro-batch":
            return C.MicroBatchSize(int(v) for v in values)
        if key == "memory":
            return C.MemoryLimit(value)
        if key == "zero":
            return C.ZeroStages(int(v) for v in values)
        if key == "recompute":
            return C.RecomputeModes(values)
        if key == "replicated":
            return C.Replicated(value)
        if key == "not-split":
            target, _, dim = value.rpartition(":")
            if not target:
                raise UsageError("not-split needs MODULE:DIM, e.g. not-split=lm_head:batch")
            return C.NotSplit(target, int(dim) if dim.lstrip("-").isdigit() else dim)
        if key == "same-layers":
            return C.SameLayerConfig()
        if key == "hf-tp-plan":
            if model is None:
                raise UsageError("hf-tp-plan needs a Hugging Face model")
            return C.HFTensorParallelPlan.of(model, require=value == "require")
    except ValueError as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"constraint {text!r}: {e}") from None
    raise UsageError(f"unknown constraint {text!r}; use one of: {', '.join(CONSTRAINT_FORMS)}")


def _cluster(name: str, world: int, nodes: Optional[int]):
    from nnscaler_plugins.search import cluster

    if name == "local-cpu":
        return cluster(name, devices=world)
    spec = cluster(name, nodes=nodes)
    if nodes is None and spec.num_devices < world:
        spec = spec.with_nodes(-(-world // spec.devices_per_node))
    return spec


# -- commands ------------------------------------------------------------------------------------------------
def cmd_search(a) -> int:
    from nnscaler_plugins.render import render_pareto
    from nnscaler_plugins.search.solver import search

    model, inputs = load_model(a.model, a.micro_batch, a.seq)
    constraints = [parse_constraint(c, model) for c in a.constraint]
    spec = _cluster(a.cluster, a.world_size, a.nodes)
    plans = search(model, world_size=a.world_size, cluster=spec, constraints=constraints, example_inputs=inputs,
                   global_batch_size=a.global_batch, memory_limit=a.memory_limit, progress=not a.no_progress)
    print(f"{len(plans)} plan(s) on the Pareto frontier for {a.world_size} devices of {spec.name} "
          f"({plans.searched} candidates priced, {plans.simulated} simulated, {plans.seconds:.1f} s):")
    print(plans.table())
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        for i, p in enumerate(plans):
            p.save(os.path.join(a.out, f"plan_{i}.json"))
        render_pareto(plans, os.path.join(a.out, "pareto.svg"), title=f"{a.model} on {a.world_size} x {spec.device}")
        with open(os.path.join(a.out, "pareto.json"), "w") as f:
            json.dump([{"plan": f"plan_{i}.json", **e.to_json()} for i, e in enumerate(plans.estimates)], f, indent=1)
        print(f"plans written to {a.out}/plan_*.json, the curve to {a.out}/pareto.svg")
    return 0


def cmd_explain(a) -> int:
    plan = Plan.load(a.plan)
    print(plan.explain())
    if plan.estimate:
        from nnscaler_plugins.search.simulator import Estimate
        print("  " + Estimate.from_json(plan.estimate).describe())
    return 0


def cmd_simulate(a) -> int:
    from nnscaler_plugins.search.simulator import simulate

    plan = Plan.load(a.plan)
    graph, _ = _graph(a.model, a.micro_batch, a.seq, plan)
    spec = _cluster(a.cluster, plan.world_size, a.nodes)
    est = simulate(plan, spec, graph, keep_timeline=bool(a.timeline))
    print(f"{plan.model_class} on {plan.world_size} devices of {spec.name}:")
    print("  " + est.describe())
    if a.timeline:
        from nnscaler_plugins.render import render_timeline
        render_timeline(est.timeline, a.timeline, title=f"{plan.model_class}: {plan.strategy}")
        print(f"timeline written to {a.timeline}")
    return 0


def cmd_show(a) -> int:
    plan = Plan.load(a.plan)
    if a.model is None:
        d = plan.to_json()
        ops = d.pop("ops")
        print(json.dumps(d, indent=1))
        print(f"{len(ops)} ops")
        print(plan.explain())
        return 0
    from nnscaler_plugins.codegen.generate import generate
    from nnscaler_plugins.lower.lowering import lower
    from nnscaler_plugins.plan.validate import validate

    graph, _ = _graph(a.model, a.micro_batch, a.seq, plan)
    validate(plan, graph)
    if not 0 <= a.rank < plan.unit_size:
        raise UsageError(f"rank {a.rank} is outside the plan's unit (devices 0..{plan.unit_size - 1}); ranks of "
                         "other data-parallel replicas run the same code as their unit device")
    print(generate(lower(graph, plan), a.rank))
    return 0


def cmd_render(a) -> int:
    from nnscaler_plugins.render import (
        render_device_map,
        render_pareto,
        render_timeline,
    )
    from nnscaler_plugins.search.simulator import simulate

    os.makedirs(a.out, exist_ok=True)
    plans = [Plan.load(p) for p in a.plans]
    written = []
    graph = None
    estimates = []
    for i, plan in enumerate(plans):
        if graph is None or graph.fingerprint() != plan.graph_fingerprint:
            graph, _ = _graph(a.model, a.micro_batch, a.seq, plan)
        spec = _cluster(a.cluster, plan.world_size, a.nodes)
        est = simulate(plan, spec, graph, keep_timeline=True)
        estimates.append(est)
        stem = os.path.splitext(os.path.basename(a.plans[i]))[0]
        for path, fn in ((f"{stem}_devices.{a.format}", lambda p: render_device_map(plan, p, graph, title=stem)),
                         (f"{stem}_timeline.{a.format}",
                          lambda p: render_timeline(est.timeline, p, title=f"{stem}: {est.describe()}"))):
            full = os.path.join(a.out, path)
            fn(full)
            written.append(full)
    pts = [(e.step_time_s, e.max_memory_bytes, os.path.basename(p)) for e, p in zip(estimates, a.plans)]
    full = os.path.join(a.out, f"pareto.{a.format}")
    render_pareto(pts, full, title="plans: step time vs peak memory")
    written.append(full)
    print("\n".join(written))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="nnscaler-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p, required: bool = True):
        p.add_argument("--model", required=required, help="config.json (or its directory) or module:factory")
        p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (config models)")
        p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (config models)")

    p = sub.add_parser("search", help="search plans; prints the Pareto set")
    p.add_argument("model", help="config.json (or its directory) or module:factory")
    p.add_argument("--world-size", "-n", type=int, required=True)
    p.add_argument("--cluster", default="local-cpu", help="preset name or YAML/JSON cluster file")
    p.add_argument("--nodes", type=int)
    p.add_argument("--global-batch", type=int, help="samples per step over all replicas")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--memory-limit", help="peak memory per device, e.g. 40GiB (default: the device's memory)")
    p.add_argument("--constraint", "-c", action="append", default=[], help=", ".join(CONSTRAINT_FORMS))
    p.add_argument("--out", help="directory for plan_*.json and pareto.svg")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("explain", help="summarise a plan (and its estimate)")
    p.add_argument("plan")
    p = sub.add_parser("simulate", help="price a plan on a cluster")
    p.add_argument("plan")
    model_args(p)
    p.add_argument("--cluster", default="local-cpu")
    p.add_argument("--nodes", type=int)
    p.add_argument("--timeline", help="also draw the pipeline timeline to this .svg/.html")
    p = sub.add_parser("show", help="the plan's JSON summary, or with --model the generated code of a rank")
    p.add_argument("plan")
    model_args(p, required=False)
    p.add_argument("--rank", type=int, default=0)
    p = sub.add_parser("render", help="draw Pareto curve, device maps and pipeline timelines")
    p.add_argument("plans", nargs="+")
    model_args(p)
    p.add_argument("--cluster", default="local-cpu")
    p.add_argument("--nodes", type=int)
    p.add_argument("--out", default=".")
    p.add_argument("--format", choices=("svg", "html"), default="svg")
    sub.add_parser("strategies", help="registered strategy names")
    p = sub.add_parser("merge-checkpoint", help="merge a sharded checkpoint into one state dict file (offline)")
    p.add_argument("checkpoint", help="directory written by nns.checkpoint.save")
    p.add_argument("out", help="the .pt file to write (model.load_state_dict takes it)")
    p.add_argument("--with-optimizer", action="store_true",
                   help='write {"model", "optimizer", "extra"} instead of the model alone')
    a = ap.parse_args(argv)
    from nnscaler_plugins.capture.tracing import CaptureError
    from nnscaler_plugins.checkpoint import CheckpointError
    from nnscaler_plugins.search.cluster import ClusterError

    try:
        if a.cmd == "strategies":
            from nnscaler_plugins.plugins import strategies
            print("\n".join(strategies()))
            return 0
        if a.cmd == "merge-checkpoint":
            from nnscaler_plugins.checkpoint import merge
            print(merge(a.checkpoint, a.out, with_optimizer=a.with_optimizer))
            return 0
        return {"search": cmd_search, "explain": cmd_explain, "simulate": cmd_simulate, "show": cmd_show,
                "render": cmd_render}[a.cmd](a)
    except (OSError, PlanError, ClusterError, CaptureError, UsageError, ValueError, ImportError, CheckpointError) as e:
        print(f"nnscaler-plan {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
