"""The Plan: the declarative result of applying primitives to a graph.

A plan says, per op, how it is split (nested `(label, num)` splits and a replication factor) and
which device runs each sub-op, for one *unit* of `unit_size` devices. Data parallelism replicates
the unit `dp` times (`world_size = unit_size * dp`), which is how one plan serves any number of
replicas. The plan is plain JSON: versioned, readable and diffable, and re-checked against the
graph it is applied to.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError, PlanFormatWarning, refuse_unknown
from nnscaler_plugins.plan import fields
from nnscaler_plugins.plan.float8 import all_gather_in_float8
from nnscaler_plugins.plan.knobs import Knobs, from_v1_options
from nnscaler_plugins.plan.mesh import Mesh, unit_mesh
from nnscaler_plugins.plan.migrate import migrated_mesh

# Version 2: the typed mesh ("mesh") and knobs ("knobs"); version 1 files are migrated when loaded.
PLAN_FORMAT_VERSION = 2
# "fp8": bf16 training whose linears run torchao's float8 matmuls (the knobs' fp8_* fields say which
# and how); master weights in fp32 as with bf16.
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# What a plan may keep in host memory instead of the device's (None: nothing). "params" (ZeRO-3
# only) also keeps the optimizer there.
OFFLOADS = (None, "optimizer", "params")

# Keys a plan file may hold, per level. Anything else is a typo or a file from another tool, and a
# key that is silently ignored is a plan that silently runs differently from what its file says.
_PLAN_KEYS = ("format", "version", "model_class", "graph_fingerprint", "structure_fingerprint", "strategy", "options", "world_size",
              "unit_size", "dp", "mesh", "knobs", "estimate", "micro_batches", "zero", "precision", "offload", "input_shapes",
              "pipeline", "ops")
_OP_KEYS = ("splits", "replicate", "devices", "blocks", "stage", "recompute")
_PIPELINE_KEYS = ("stage_devices", "stage_rank", "micro_batches", "schedule", "split_backward", "options", "tasks")


def check_keys(d: Any, allowed: tuple[str, ...], where: str) -> None:
    """Refuse keys outside `allowed`, naming each with the closest valid one."""
    if not isinstance(d, dict):
        raise PlanError(f"{where} must be a JSON object, not {type(d).__name__}")
    refuse_unknown(d, allowed, "key", where)


@dataclass
class OpPlacement:
    """How one op is split and where its pieces run.

    Sub-ops are numbered row-major over the digits (replica, split_1, ..., split_k): the replica
    digit is outermost, then splits in the order they were applied.
    """

    splits: list[tuple[str, int]] = field(default_factory=list)
    replicate: int = 1
    devices: list[Optional[int]] = field(default_factory=lambda: [None])
    # label -> b: that label is split in b blocks (each piece takes its chunk of every block), as a
    # fused QKV projection must be so that q, k and v each end up split by heads.
    blocks: dict[str, int] = field(default_factory=dict)
    stage: Optional[int] = None  # pipeline stage (plans with op_order); None without a pipeline
    recompute: Optional[int] = None  # recompute group: its activations are recomputed in backward

    @property
    def num_subops(self) -> int:
        return self.replicate * math.prod(n for _, n in self.splits)

    def digits(self, index: int) -> tuple[int, ...]:
        """Multi-index (replica, s_1, ..., s_k) of a flat sub-op index."""
        radices = [self.replicate] + [n for _, n in self.splits]
        out = []
        for r in reversed(radices):
            out.append(index % r)
            index //= r
        return tuple(reversed(out))

    @property
    def coshard(self) -> int:
        """Pieces per device: with co-shard, consecutive pieces of the innermost split share a device
        and run one after another (recomputed in backward), cutting peak activation memory."""
        used = [d for d in self.devices if d is not None]
        if not self.splits or len(set(used)) == len(used):
            return 1
        return len(used) // max(1, len(set(used)))

    def unit_view(self) -> "OpPlacement":
        """The placement with each device's co-sharded pieces taken as one piece (what the layouts see)."""
        c = self.coshard
        if c == 1:
            return self
        label, num = self.splits[-1]
        return OpPlacement(self.splits[:-1] + [(label, num // c)], self.replicate, self.devices[::c], self.blocks,
                           self.stage, self.recompute)

    def label_counts(self) -> dict[str, int]:
        """Total pieces per label (nested splits of one label multiply)."""
        out: dict[str, int] = {}
        for l, n in self.splits:
            out[l] = out.get(l, 1) * n
        return out

    def label_index(self, index: int) -> dict[str, int]:
        """Per label, the piece index of sub-op `index` (nested splits combine row-major)."""
        d = self.digits(index)[1:]
        out: dict[str, int] = {}
        for (l, n), i in zip(self.splits, d):
            out[l] = out.get(l, 0) * n + i
        return out

    def to_json(self) -> dict:
        out = {"splits": [list(s) for s in self.splits], "replicate": self.replicate, "devices": self.devices}
        if self.blocks:
            out["blocks"] = dict(self.blocks)
        if self.stage is not None:
            out["stage"] = self.stage
        if self.recompute is not None:
            out["recompute"] = self.recompute
        return out

    @classmethod
    def from_json(cls, d: dict, name: str = "op") -> "OpPlacement":
        check_keys(d, _OP_KEYS, f"plan entry for op {name!r}")
        at = f"ops[{name!r}]"

        def split(x: Any, field: str) -> tuple[str, int]:
            label, num = fields.sequence(x, field, length=2)
            return fields.text(label, f"{field}[0] (the dim label)"), fields.integer(num, f"{field}[1] (pieces)", 1)

        def device(x: Any, field: str) -> Optional[int]:
            return fields.optional_integer(x, field, 0)

        blocks = fields.mapping(d.get("blocks"), f"{at}.blocks", optional=True)
        return cls(fields.sequence(d.get("splits", []), f"{at}.splits", split),
                   fields.integer(d.get("replicate", 1), f"{at}.replicate", 1),
                   fields.sequence(d.get("devices", [None]), f"{at}.devices", device),
                   {l: fields.integer(b, f"{at}.blocks[{l!r}]") for l, b in blocks.items()},
                   fields.optional_integer(d.get("stage"), f"{at}.stage", 0),
                   fields.optional_integer(d.get("recompute"), f"{at}.recompute", 0))


@dataclass
class PipelineSpec:
    """op-order for pipelines: which devices run each stage, how many micro-batches, in what order.

    `stage_devices[k]` is the device group of stage k (unit devices); stages that share a pipeline
    rank (`stage_rank`, interleaved chunks) share its group. The order is a built-in schedule by
    name, or, for a schedule written by the user, the task lists it produced (kept in the plan, so
    a saved plan runs without the function that made it).
    """

    stage_devices: list[list[int]]
    micro_batches: int
    schedule: str = "1f1b"
    stage_rank: list[int] = field(default_factory=list)
    split_backward: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    tasks: Optional[list[list[Any]]] = None  # explicit per-rank Task lists

    def __post_init__(self) -> None:
        if not self.stage_rank:
            groups: list[tuple[int, ...]] = []
            for devs in self.stage_devices:
                if tuple(devs) not in groups:
                    groups.append(tuple(devs))
            # A group that contains others runs on every pipeline rank at once (a shared stage).
            ranks = [g for g in groups if not any(set(h) < set(g) for h in groups)]
            self.stage_rank = [ranks.index(tuple(d)) if tuple(d) in ranks else -1 for d in self.stage_devices]

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def num_ranks(self) -> int:
        return max(self.stage_rank) + 1

    def rank_devices(self, rank: int) -> list[int]:
        return list(self.stage_devices[self.stage_rank.index(rank)])

    def rank_of_device(self, device: int) -> int:
        """The pipeline rank whose own stages run on `device`."""
        return next(r for k, r in enumerate(self.stage_rank) if r >= 0 and device in self.stage_devices[k])

    def shape(self):
        from nnscaler_plugins.plan.schedules import PipelineShape
        return PipelineShape(self.num_stages, self.num_ranks, self.micro_batches, tuple(self.stage_rank),
                             self.split_backward)

    def task_lists(self):
        """Per pipeline rank, the ordered tasks of one training step."""
        from nnscaler_plugins.plan.schedules import build
        if self.tasks is not None:
            return [list(t) for t in self.tasks]
        return build(self.schedule, self.shape(), **self.options)

    def to_json(self) -> dict:
        out = {"stage_devices": [list(d) for d in self.stage_devices], "stage_rank": list(self.stage_rank),
               "micro_batches": self.micro_batches, "schedule": self.schedule,
               "split_backward": self.split_backward, "options": self.options}
        if self.tasks is not None:
            out["tasks"] = [[t.to_json() for t in tasks] for tasks in self.tasks]
        return out

    @classmethod
    def from_json(cls, d: dict) -> "PipelineSpec":
        from nnscaler_plugins.plan.schedules import Task
        check_keys(d, _PIPELINE_KEYS, "the plan's pipeline")
        missing = [k for k in ("stage_devices", "micro_batches") if k not in d]
        if missing:
            raise PlanError(f"the plan's pipeline lacks {', '.join(missing)}")
        at = "pipeline"

        def devices(x: Any, field: str) -> list[int]:
            return fields.sequence(x, field, lambda v, f: fields.integer(v, f, 0))

        def task(x: Any, field: str) -> Any:
            t = fields.sequence(x, field)
            if not 3 <= len(t) <= 5:
                raise PlanError(f"{field} = {x!r}: must be [kind, stage, micro-batch] (and optionally grad, round)")
            fields.text(t[0], f"{field}[0] (the task's kind)")
            for i, what in ((1, "stage"), (2, "micro-batch"), *(((4, "round"),) if len(t) > 4 else ())):
                fields.integer(t[i], f"{field}[{i}] (the {what})", 0)
            if len(t) > 3:
                fields.boolean(t[3], f"{field}[3] (grad)")
            return Task.from_json(t)

        tasks = d.get("tasks")
        return cls(fields.sequence(d["stage_devices"], f"{at}.stage_devices", devices),
                   fields.integer(d["micro_batches"], f"{at}.micro_batches", 1),
                   fields.text(d.get("schedule", "1f1b"), f"{at}.schedule"),
                   fields.sequence(d.get("stage_rank", []), f"{at}.stage_rank",
                                   lambda v, f: fields.integer(v, f, -1)),
                   fields.boolean(d.get("split_backward", False), f"{at}.split_backward"),
                   dict(fields.mapping(d.get("options"), f"{at}.options", optional=True)),
                   None if tasks is None else fields.sequence(
                       tasks, f"{at}.tasks", lambda ts, f: fields.sequence(ts, f, task)))


@dataclass
class Plan:
    graph_fingerprint: str
    model_class: str
    unit_size: int
    dp: int
    ops: dict[str, OpPlacement]
    strategy: str = "custom"
    options: dict[str, Any] = field(default_factory=dict)
    estimate: Optional[dict[str, Any]] = None
    version: int = PLAN_FORMAT_VERSION
    pipeline: Optional[PipelineSpec] = None
    # Micro-batches per training step when there is no pipeline (gradient accumulation in train_step).
    micro_batches: int = 1
    # Shapes of the graph inputs the plan was made for (one micro-batch), for messages.
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    # The graph the plan was made for, when it was made in this process (not saved): lets
    # `nns.simulate(plan, cluster)` price it without being handed the graph again.
    graph: Optional[Graph] = field(default=None, repr=False, compare=False)
    # Training knobs the runtime honours: ZeRO stage (0-3: optimizer state, + gradients, + parameters
    # sharded across data-parallel replicas) and compute precision (fp32 | bf16 | fp16 | fp8, all but
    # the first with fp32 master weights in the optimizer; fp8 is bf16 with float8 linears).
    zero: int = 0
    precision: str = "fp32"
    # Host-memory offload: None, "optimizer" (optimizer state and step on the host) or "params"
    # (ZeRO-3 parameter chunks on the host too, fetched to the device when used).
    offload: Optional[str] = None
    # The graph's fingerprint without the sizes that follow its inputs (Graph.structure_fingerprint):
    # the plan also fits the model captured at another batch size or length.
    structure_fingerprint: str = ""
    # The plan's devices as named axes (the one source of its degrees; see mesh.py). A plan made
    # without one gets the bare {"dp": dp, "unit": unit_size}.
    mesh: Optional[Mesh] = None
    # Typed knobs: how the plan trains and communicates (see knobs.py).
    knobs: Knobs = field(default_factory=Knobs)

    def __post_init__(self) -> None:
        if self.mesh is None:
            self.mesh = unit_mesh(self.unit_size, self.dp)
        if (self.mesh.unit_size, self.mesh.replicas) != (self.unit_size, self.dp):
            raise PlanError(f"the plan's mesh {self.mesh.describe()} has {self.mesh.replicas} replica(s) of "
                            f"{self.mesh.unit_size} device(s), but the plan says dp {self.dp} x unit {self.unit_size}")
        self.check_training_knobs()

    def check_training_knobs(self) -> None:
        """ZeRO stage and precision are checked before any process starts, not deep in a step."""
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"zero={self.zero!r}: the ZeRO stage must be 0 (off), 1 (optimizer state sharded), "
                            "2 (+ gradients) or 3 (+ parameters)")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.offload == "nvme":
            raise PlanError("offload='nvme' is not supported: parameters and optimizer state can be offloaded to "
                            "host memory only; use offload='optimizer' or offload='params'")
        if self.offload not in OFFLOADS:
            raise PlanError(f"offload={self.offload!r}: choose None, 'optimizer' (optimizer state and step in host "
                            "memory) or 'params' (ZeRO-3 parameters too)")
        if self.offload == "params" and self.zero != 3:
            raise PlanError(f"offload='params' keeps ZeRO-3's parameter chunks in host memory; this plan has "
                            f"zero={self.zero}. Use zero=3 with it, or offload='optimizer'")
        all_gather_in_float8(self.precision, self.zero, self.dp, self.knobs)  # refuses fp8_all_gather=True where it cannot apply

    def check_runnable(self) -> None:
        """What the runtime cannot execute yet (the search may still price such plans)."""
        self.check_training_knobs()
        if self.zero == 3 and self.pipeline is not None and self.pipeline.split_backward and self.dp > 1:
            raise PlanError(f"zero=3 with schedule {self.pipeline.schedule!r}, which splits the backward into input "
                            "and weight parts, is not supported: ZeRO-3 gathers each parameter inside the backward "
                            "it belongs to. Use zero=3 with gpipe, 1f1b or interleaved, or zero=1/2 with "
                            f"{self.pipeline.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.unit_size * self.dp

    def __getstate__(self) -> dict:
        """Pickled (sent to other processes) without its graph, which is process-local."""
        state = dict(self.__dict__)
        state["graph"] = None
        return state

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per training step (the pipeline's, or gradient accumulation's)."""
        return self.pipeline.micro_batches if self.pipeline is not None else self.micro_batches

    # -- persistence ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": "nnscaler-plan",
            "version": self.version,
            "model_class": self.model_class,
            "graph_fingerprint": self.graph_fingerprint,
            "structure_fingerprint": self.structure_fingerprint,
            "strategy": self.strategy,
            "options": self.options,
            "world_size": self.world_size,
            "unit_size": self.unit_size,
            "dp": self.dp,
            "mesh": self.mesh.to_json(),
            "knobs": self.knobs.to_json(),
            "estimate": self.estimate,
            "micro_batches": self.micro_batches,
            "zero": self.zero,
            "precision": self.precision,
            "offload": self.offload,
            "input_shapes": self.input_shapes,
            "pipeline": None if self.pipeline is None else self.pipeline.to_json(),
            "ops": {name: p.to_json() for name, p in self.ops.items()},
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write never leaves a truncated plan behind."""
        path = os.fspath(path)
        text = json.dumps(self.to_json(), indent=1, sort_keys=False, default=str)
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".plan-", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"a plan file holds one JSON object (with 'format': 'nnscaler-plan'), not a "
                            f"{type(d).__name__}")
        if d.get("format") != "nnscaler-plan":
            raise PlanError("not an nnscaler plan file (missing 'format': 'nnscaler-plan')")
        v = fields.integer(d.get("version", 0), "version", 0)
        if v > PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {v} is newer than this library understands "
                            f"({PLAN_FORMAT_VERSION}); upgrade nnscaler-plugins")
        check_keys(d, _PLAN_KEYS, "plan file")
        missing = [k for k in ("graph_fingerprint", "unit_size", "ops") if k not in d]
        if missing:
            raise PlanError(f"plan file lacks {', '.join(missing)}: it was not written by Plan.save")
        if not isinstance(d["ops"], dict):
            raise PlanError("the plan's 'ops' must map op names to placements")
        unit, dp = fields.integer(d["unit_size"], "unit_size", 1), fields.integer(d.get("dp", 1), "dp", 1)
        if "world_size" in d and fields.integer(d["world_size"], "world_size", 1) != unit * dp:
            raise PlanError(f"plan file says world_size {d['world_size']} but unit_size {unit} x dp {dp} = "
                            f"{unit * dp}; the file was edited inconsistently")
        options = dict(fields.mapping(d.get("options"), "options", optional=True))
        pipeline = None if d.get("pipeline") is None else PipelineSpec.from_json(d["pipeline"])
        zero = d["zero"] if "zero" in d else options.get("zero", 0) or 0
        offload = d.get("offload")
        estimate = d.get("estimate")
        if estimate is not None:
            fields.mapping(estimate, "estimate")
        shapes = fields.mapping(d.get("input_shapes"), "input_shapes", optional=True)
        if v < 2:
            knobs, options, moved = from_v1_options(options)
            mesh = migrated_mesh(unit, dp, pipeline, options, str(d.get("strategy", "")))
            warnings.warn(f"plan file format {v} migrated to {PLAN_FORMAT_VERSION}: its mesh is read as "
                          f"{mesh.describe()}" + (f" and {', '.join(moved)} moved from its options to typed knobs"
                                                  if moved else "") + "; Plan.save writes the new format",
                          PlanFormatWarning, stacklevel=3)
        else:
            mesh = Mesh.from_json(d["mesh"]) if d.get("mesh") is not None else None
            knobs = Knobs.from_json(d.get("knobs") or {})
        return cls(graph_fingerprint=fields.text(d["graph_fingerprint"], "graph_fingerprint"),
                   model_class=fields.text(d.get("model_class", ""), "model_class"),
                   unit_size=unit, dp=dp,
                   ops={k: OpPlacement.from_json(p, k) for k, p in d["ops"].items()},
                   strategy=fields.text(d.get("strategy", "custom"), "strategy"), options=options,
                   estimate=estimate, version=PLAN_FORMAT_VERSION, mesh=mesh, knobs=knobs,
                   pipeline=pipeline,
                   micro_batches=fields.integer(d.get("micro_batches", 1), "micro_batches", 1),
                   # files written before `zero` was a field (the search's) carry it in options
                   zero=fields.integer(zero, "zero", 0),
                   precision=fields.text(d.get("precision", "fp32"), "precision"),
                   offload=None if offload is None else fields.text(offload, "offload"),
                   input_shapes={k: fields.sequence(v, f"input_shapes[{k!r}]",
                                                    lambda x, f: fields.integer(x, f, 0))
                                 for k, v in shapes.items()},
                   structure_fingerprint=fields.text(d.get("structure_fingerprint", ""), "structure_fingerprint"))

    @classmethod
    def load(cls, path: str | os.PathLike, graph: Optional[Graph] = None,
             world_size: Optional[int] = None) -> "Plan":
        """Read a plan; with `graph` (and `world_size`) it is validated against them at once."""
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from e
        plan = cls.from_json(d)
        if graph is not None:
            from nnscaler_plugins.plan.validate import validate
            validate(plan, graph, world_size=world_size)
        return plan

    # -- reading ----------------------------------------------------------------------------------
    def explain(self, graph: Optional[Graph] = None) -> str:
        """A short human summary: strategy, degrees, and how ops are split (grouped by pattern)."""
        from nnscaler_plugins.plan.label import plan_label
        from nnscaler_plugins.units import fmt_bytes, fmt_seconds

        # the search's internal summary is said in words below; floats rounded for reading
        shown = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in self.options.items()
                 if k != "summary"}
        lines = [f"Plan for {self.model_class} ({self.strategy}{' ' + str(shown) if shown else ''}): {plan_label(self)}",
                 f"  world size {self.world_size} = {self.dp} data-parallel replica(s) x {self.unit_size} "
                 f"device(s) per replica"]
        if self.pipeline is not None:
            pl = self.pipeline
            counts = [sum(1 for p in self.ops.values() if p.stage == k) for k in range(pl.num_stages)]
            lines.append(f"  pipeline: {pl.num_stages} stages on {pl.num_ranks} ranks, {pl.micro_batches} micro-batches, "
                         f"schedule {pl.schedule}{' (backward split into B and W)' if pl.split_backward else ''}")
            for k, (devs, n) in enumerate(zip(pl.stage_devices, counts)):
                rank = "every rank" if pl.stage_rank[k] < 0 else f"rank {pl.stage_rank[k]}"
                lines.append(f"    stage {k}: {rank}, devices {devs}, {n} ops")
        elif self.micro_batches > 1:
            lines.append(f"  {self.micro_batches} micro-batches per step (gradients accumulated)")
        if self.zero or self.precision != "fp32" or self.offload:
            lines.append(f"  training: ZeRO stage {self.zero}, precision {self.precision}"
                         + (f", {self.offload} offloaded to host memory" if self.offload else ""))
        if self.knobs.executor == "eager":
            lines.append("  runs: the model's own forward, eagerly on every replica (gradients reduced from module "
                         "hooks" + (", each module's parameters gathered on use" if self.zero >= 3 else "") + "), "
                         f"because {self.knobs.eager_reason or 'executor=eager was asked for'}")
        elif self.ops:
            lines.append("  runs: the code generated from the captured graph (one file per device)")
        groups = {p.recompute for p in self.ops.values() if p.recompute is not None}
        if groups:
            n = sum(1 for p in self.ops.values() if p.recompute is not None)
            lines.append(f"  recompute: {n} ops in {len(groups)} groups recomputed in backward")
        patterns: dict[str, list[str]] = {}
        for name, p in self.ops.items():
            key = ("replicated" if not p.splits else
                   " x ".join(f"{l}/{n}" + (f" in {p.blocks[l]} blocks" if p.blocks.get(l, 1) > 1 else "")
                              for l, n in p.splits)) + (f" (x{p.replicate} copies)" if p.replicate > 1 else "")
            patterns.setdefault(key, []).append(name)
        for key, names in sorted(patterns.items(), key=lambda kv: -len(kv[1])):
            ops = names if graph is None else [n if n.split("_")[0] == graph.op(n).short_name.split("_")[0]
                                               else f"{n}:{graph.op(n).short_name}" for n in names]
            shown = ", ".join(ops[:6]) + (f", ... ({len(ops)} ops)" if len(ops) > 6 else "")
            lines.append(f"  {key:<28} {shown}")
        if self.estimate:
            est, details = self.estimate, self.estimate.get("details") or {}
            priced = (details.get("training") or {}).get("dtype")
            lines.append(f"  estimate on {est.get('cluster') or 'its cluster'}: step {fmt_seconds(est['step_time_s'])} "
                         f"(compute {fmt_seconds(est.get('compute_s', 0))}, communication "
                         f"{fmt_seconds(est.get('communication_s', 0))}, bubble {fmt_seconds(est.get('bubble_s', 0))}), "
                         f"peak memory per device {fmt_bytes(est.get('max_memory_bytes', 0))}"
                         + (f"; priced in {priced}, runs in {self.precision}" if priced and priced != self.precision
                            else ""))
        return "\n".join(lines)

    def timeline(self, duration: Any = None, transfer: Any = None, per_device: bool = False):
        """The pipeline's training step as the executor runs it: the plan's own task lists replayed on
        a clock (unit task times unless `duration(rank, task)` / `transfer(src, dst)` say otherwise).
        `per_device` gives one row per device of the unit instead of one per pipeline rank."""
        from nnscaler_plugins.plan.timeline import Timeline, replay

        if self.pipeline is None:
            raise PlanError("this plan has no pipeline; only pipeline plans have a task timeline")
        spec = self.pipeline
        tl = replay(spec.task_lists(), spec.shape(), duration, transfer)
        if not per_device:
            return tl
        ranks = [spec.rank_of_device(d) for d in range(self.unit_size)]
        return Timeline(tl.shape, [tl.events[r] for r in ranks], [tl.peak_in_flight[r] for r in ranks])

    def render_timeline(self, path: str | os.PathLike, duration: Any = None, transfer: Any = None) -> str:
        """Write the pipeline timeline (one row per device, one box per task, gaps are bubbles) as SVG,
        or as a page when `path` ends in .html; returns the SVG."""
        from nnscaler_plugins.plan.timeline_picture import render_timeline

        tl = self.timeline(duration, transfer, per_device=True)
        title = (f"{self.model_class}: {self.pipeline.schedule}, {self.pipeline.num_stages} stages, "
                 f"{self.pipeline.micro_batches} micro-batches")
        return render_timeline(tl, os.fspath(path), title=title, row_label="device",
                               unit="s" if duration is not None else "task")

    def __str__(self) -> str:
        return self.explain()
