"""`nnscaler-plan`: search, look at, price and draw plans from the shell.

    nnscaler-plan search --model gpt2-xl/config.json --world-size 64 --cluster a100-dgx --global-batch 512 \\
                         --seq 1024 --constraint max-tp --constraint memory=40GiB --out plans/
    nnscaler-plan search --model mypkg.models:build --world-size 8 --cluster my-cluster.yaml
    nnscaler-plan explain plans/plan_0.json
    nnscaler-plan simulate plans/plan_0.json --model gpt2-xl/config.json     # on the cluster it was searched for
    nnscaler-plan show plans/plan_0.json [--model MODEL --rank 3]     # the JSON summary, or rank 3's code
    nnscaler-plan render plans/plan_0.json --model MODEL --out pictures/
    nnscaler-plan strategies

Every subcommand takes the model as `--model` (search's older positional form still works, with a
note). `simulate` and `render` price a plan on the cluster it was searched for unless `--cluster`
says otherwise. `search --out DIR` replaces the files an earlier search wrote there (listed in
DIR/nnscaler-search.json) and refuses a folder holding plan files it did not write.

A model is a Hugging Face config file (or a directory holding config.json), built on the meta device
with `--micro-batch` sequences of `--seq` tokens, or `module:factory` (a module name or a .py
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
import re
import sys
from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.progress import Progress, phase
from nnscaler_plugins.render import fmt_bytes, fmt_seconds, plan_label

MANIFEST = "nnscaler-search.json"  # what a search wrote into --out, so the next one can replace exactly that

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
    from nnscaler_plugins.batches import normalize_inputs
    from nnscaler_plugins.api import capture

    if plan is not None and plan.input_shapes:
        shape = next(iter(plan.input_shapes.values()))
        if len(shape) >= 1:
            micro_batch = int(shape[0])
        if len(shape) == 2:
            seq = int(shape[1])
    model, inputs = load_model(spec, micro_batch, seq)
    args, kwargs = normalize_inputs(inputs, None)
    with phase(f"capturing {type(model).__name__} from {spec}"):
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


def _plan_cluster(a, plan: Plan) -> str:
    """--cluster, else the cluster the plan was searched (or priced) for, else this machine."""
    if a.cluster:
        return a.cluster
    searched = plan.knobs.cluster or (plan.estimate or {}).get("cluster")
    if isinstance(searched, str) and searched:
        print(f"pricing on {searched}, the cluster the plan was searched for (--cluster to choose another)",
              file=sys.stderr)
        return searched
    print("pricing on local-cpu (this machine): the plan names no cluster; --cluster to choose one", file=sys.stderr)
    return "local-cpu"


def _cluster(name: str, world: int, nodes: Optional[int]):
    from nnscaler_plugins.search import cluster

    if name == "local-cpu":
        return cluster(name, devices=world)
    spec = cluster(name, nodes=nodes)
    if nodes is None and spec.num_devices < world:
        spec = spec.with_nodes(-(-world // spec.devices_per_node))
    return spec


def parse_lengths(text: str) -> dict[int, float]:
    """`--lengths 512,1024,4096` (equal weights) or `512:6,2048:3,8192:1` (length:weight)."""
    out: dict[int, float] = {}
    for part in text.split(","):
        length, _, weight = part.strip().partition(":")
        try:
            out[int(length)] = out.get(int(length), 0.0) + (float(weight) if weight else 1.0)
        except ValueError:
            raise UsageError(f"--lengths {text!r}: write lengths as 512,1024 or length:weight pairs as "
                             "512:6,2048:1") from None
    return out


# -- commands ------------------------------------------------------------------------------------------------
def cmd_search(a) -> int:
    from nnscaler_plugins.render import render_pareto
    from nnscaler_plugins.search.solver import search

    if a.out:
        previous = _check_out(a.out)  # before the search: refuse early, not after minutes of work
    model, inputs = load_model(a.model, a.micro_batch, a.seq)
    constraints = [parse_constraint(c, model) for c in a.constraint]
    spec = _cluster(a.cluster, a.world_size, a.nodes)
    plans = search(model, world_size=a.world_size, cluster=spec, constraints=constraints, example_inputs=inputs,
                   global_batch_size=a.global_batch, memory_limit=a.memory_limit, progress=not a.no_progress,
                   precision=a.precision, lengths=parse_lengths(a.lengths) if a.lengths else None)
    print(f"{len(plans)} plan(s) on the Pareto frontier for {a.world_size} devices of {spec.name} "
          f"({plans.searched} candidates priced, {plans.simulated} simulated, {plans.seconds:.1f} s):")
    print(plans.table())
    if a.out:
        for name in previous:  # only files an earlier search listed as its own
            path = os.path.join(a.out, name)
            if os.path.isfile(path):
                os.remove(path)
        os.makedirs(a.out, exist_ok=True)
        written = []
        for i, p in enumerate(plans):
            p.save(os.path.join(a.out, f"plan_{i}.json"))
            written.append(f"plan_{i}.json")
        limit = _memory_limit_bytes(a.memory_limit, spec)
        render_pareto(plans, os.path.join(a.out, "pareto.svg"), title=f"{a.model} on {a.world_size} x {spec.device}",
                      memory_limit=limit)
        with open(os.path.join(a.out, "pareto.json"), "w") as f:
            json.dump([{"plan": f"plan_{i}.json", **e.to_json()} for i, e in enumerate(plans.estimates)], f, indent=1)
        written += ["pareto.svg", "pareto.json"]
        with open(os.path.join(a.out, MANIFEST), "w") as f:
            json.dump({"model": a.model, "world_size": a.world_size, "cluster": spec.name, "files": written}, f,
                      indent=1)
        replaced = f" (replacing the {len(previous)} files of the earlier search)" if previous else ""
        print(f"plans written to {a.out}/plan_*.json, the curve to {a.out}/pareto.svg{replaced}")
    return 0


def _memory_limit_bytes(text: Optional[str], spec) -> Optional[float]:
    if not text:
        return float(spec.memory_bytes)
    from nnscaler_plugins.search.constraints import MemoryLimit
    return float(MemoryLimit(text).limit)


def _check_out(out: str) -> list[str]:
    """The files an earlier search wrote into `out` (to replace), or UsageError when `out` holds plan
    files no search listed: those may be the user's, and are never deleted or mixed with new ones."""
    if not os.path.isdir(out):
        return []
    ours = {"pareto.svg", "pareto.json"}
    previous: list[str] = []
    manifest = os.path.join(out, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                previous = [str(n) for n in json.load(f).get("files", []) if os.path.basename(str(n)) == str(n)]
        except (OSError, ValueError, AttributeError):
            raise UsageError(f"{manifest} is not a search's list of files; remove it or choose another --out") \
                from None
        previous.append(MANIFEST)
    strangers = sorted(n for n in os.listdir(out) if n not in previous
                       and (n in ours or (n.startswith("plan_") and n.endswith(".json"))))
    if strangers:
        shown = ", ".join(strangers[:4]) + (f" and {len(strangers) - 4} more" if len(strangers) > 4 else "")
        raise UsageError(f"--out {out} already holds {shown}, not listed as written by an earlier search "
                         f"({MANIFEST}); new plans would mix with them. Choose an empty folder, or remove them")
    return previous


def cmd_explain(a) -> int:
    print(explain(Plan.load(a.plan)))
    return 0


def explain(plan: Plan) -> str:
    """A plan for reading: what it is in words, one line per pipeline stage (or device group),
    training settings, and its estimate rounded with units; how each op is split is `show`'s."""
    lines = [f"{plan.model_class} on {plan.world_size} devices: {plan_label(plan)}",
             f"  {plan.dp} data-parallel replica(s) x {plan.unit_size} device(s) per replica"
             + (f"; searched for {plan.knobs.cluster}" if plan.knobs.cluster else "")]
    est = plan.estimate or {}
    details = est.get("details", {})
    fwd, bwd = details.get("stage_fwd_s", []), details.get("stage_bwd_s", [])
    stage_of = [p.stage or 0 for p in plan.ops.values()]
    if plan.pipeline is not None:
        pl = plan.pipeline
        for k, devs in enumerate(pl.stage_devices):
            n = sum(1 for s in stage_of if s == k)
            times = f"; forward {fmt_seconds(fwd[k])}, backward {fmt_seconds(bwd[k])} per micro-batch" \
                if k < len(fwd) and k < len(bwd) else ""
            lines.append(f"  stage {k}: devices {_ranges(devs)}, {n} ops{times}")
    else:
        n = len(plan.ops)
        split = sum(1 for p in plan.ops.values() if p.splits)
        times = f"; forward {fmt_seconds(fwd[0])}, backward {fmt_seconds(bwd[0])} per micro-batch" \
            if fwd and bwd else ""
        lines.append(f"  devices {_ranges(range(plan.unit_size))} of each replica: {n} ops, {split} split{times}")
    priced = (details.get("training") or {}).get("dtype")
    precision = f"precision {plan.precision}"
    if priced and priced != plan.precision:
        precision += f" (note: the estimate was priced in {priced})"
    lines.append(f"  training: {plan.num_micro_batches} micro-batch(es) per step, ZeRO stage {plan.zero}, {precision}")
    if est:
        lines.append(f"  estimate on {est.get('cluster') or 'its cluster'}: step {fmt_seconds(est['step_time_s'])} "
                     f"(compute {fmt_seconds(est.get('compute_s', 0))}, communication "
                     f"{fmt_seconds(est.get('communication_s', 0))}, bubble {fmt_seconds(est.get('bubble_s', 0))}, "
                     f"optimizer {fmt_seconds(details.get('optimizer_s', 0))})")
        peaks = est.get("peak_memory_bytes", [])
        mem = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.get("memory", {}).items() if v)
        lines.append(f"  peak memory per device: {fmt_bytes(max(peaks, default=0))}" + (f" ({mem})" if mem else ""))
        groups: dict[str, list[int]] = {}
        for d, v in enumerate(peaks):
            groups.setdefault(fmt_bytes(v), []).append(d)
        if len(groups) > 1:
            for text, devs in groups.items():
                lines.append(f"    devices {_ranges(devs)}: {text}")
    else:
        lines.append("  no estimate: `nnscaler-plan simulate PLAN --model MODEL` prices it")
    return "\n".join(lines)


def _ranges(devs) -> str:
    """0-3, 8, 10-11: device lists as people write them."""
    devs = sorted(devs)
    out, i = [], 0
    while i < len(devs):
        j = i
        while j + 1 < len(devs) and devs[j + 1] == devs[j] + 1:
            j += 1
        out.append(str(devs[i]) if i == j else f"{devs[i]}-{devs[j]}")
        i = j + 1
    return ", ".join(out)


def cmd_simulate(a) -> int:
    from nnscaler_plugins.search.simulator import simulate

    plan = Plan.load(a.plan)
    graph, _ = _graph(a.model, a.micro_batch, a.seq, plan)
    spec = _cluster(_plan_cluster(a, plan), plan.world_size, a.nodes)
    with phase(f"simulating on {spec.name}"):
        est = simulate(plan, spec, graph, keep_timeline=bool(a.timeline))
    plan.estimate = est.to_json()
    print(explain(plan))
    if a.timeline:
        from nnscaler_plugins.render import render_timeline
        render_timeline(est.timeline, a.timeline, title=f"{plan.model_class}: {plan_label(plan)}", estimate=est)
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
    bar = Progress("rendering", len(plans), delay_s=2.0)
    for i, plan in enumerate(plans):
        stem = os.path.splitext(os.path.basename(a.plans[i]))[0]
        bar.set(stem)
        if graph is None or graph.fingerprint() != plan.graph_fingerprint:
            graph, _ = _graph(a.model, a.micro_batch, a.seq, plan)
        spec = _cluster(_plan_cluster(a, plan), plan.world_size, a.nodes)
        est = simulate(plan, spec, graph, keep_timeline=True)
        estimates.append(est)
        for path, fn in ((f"{stem}_devices.{a.format}", lambda p: render_device_map(plan, p, graph, title=stem)),
                         (f"{stem}_timeline.{a.format}",
                          lambda p: render_timeline(est.timeline, p, title=f"{stem}: {plan_label(plan)}",
                                                    estimate=est))):
            full = os.path.join(a.out, path)
            fn(full)
            written.append(full)
        bar.step()
    bar.close()
    # numbered as the files are: plan_3.json is #3 here as in the search's table
    pts = [(e.step_time_s, e.max_memory_bytes, plan_label(plan), _mark(p, i))
           for i, (e, plan, p) in enumerate(zip(estimates, plans, a.plans))]
    full = os.path.join(a.out, f"pareto.{a.format}")
    render_pareto(pts, full, title="plans: step time vs peak memory per device")
    written.append(full)
    print("\n".join(written))
    return 0


def _mark(path: str, i: int) -> str:
    m = re.fullmatch(r"plan_(\d+)\.json", os.path.basename(path))
    return f"#{m.group(1)}" if m else os.path.splitext(os.path.basename(path))[0]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="nnscaler-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p, required: bool = True):
        p.add_argument("--model", required=required, help="config.json (or its directory) or module:factory")
        p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (config models)")
        p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (config models)")

    p = sub.add_parser("search", help="search plans; prints the Pareto set")
    p.add_argument("model_positional", nargs="?", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--model", help="config.json (or its directory) or module:factory")
    p.add_argument("--world-size", "-n", type=int, required=True)
    p.add_argument("--cluster", default="local-cpu", help="preset name or YAML/JSON cluster file")
    p.add_argument("--nodes", type=int)
    p.add_argument("--global-batch", type=int, help="samples per step over all replicas")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--memory-limit", help="peak memory per device, e.g. 40GiB (default: the device's memory)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="what plans are priced and run in (default: the cluster's training dtype)")
    p.add_argument("--lengths", help="sequence lengths to price for: 512,2048 or a histogram 512:6,2048:1 "
                                     "(default: --seq alone)")
    p.add_argument("--constraint", "-c", action="append", default=[], help=", ".join(CONSTRAINT_FORMS))
    p.add_argument("--out", help="directory for plan_*.json and pareto.svg (an earlier search's files there are "
                                 "replaced)")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("explain", help="summarise a plan (and its estimate)")
    p.add_argument("plan")
    p = sub.add_parser("simulate", help="price a plan on a cluster")
    p.add_argument("plan")
    model_args(p)
    p.add_argument("--cluster", help="preset or file (default: the cluster the plan was searched for)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--timeline", help="also draw the pipeline timeline to this .svg/.html")
    p = sub.add_parser("show", help="the plan's JSON summary, or with --model the generated code of a rank")
    p.add_argument("plan")
    model_args(p, required=False)
    p.add_argument("--rank", type=int, default=0)
    p = sub.add_parser("render", help="draw Pareto curve, device maps and pipeline timelines")
    p.add_argument("plans", nargs="+")
    model_args(p)
    p.add_argument("--cluster", help="preset or file (default: the cluster each plan was searched for)")
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
    if a.cmd == "search":
        if a.model_positional and a.model:
            ap.error("search: give the model once, as --model")
        if a.model_positional:
            print("nnscaler-plan search: the model as a positional argument is deprecated; use --model "
                  f"{a.model_positional}", file=sys.stderr)
            a.model = a.model_positional
        if not a.model:
            ap.error("search: --model is required (a config.json, its directory, or module:factory)")
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
