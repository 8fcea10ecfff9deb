"""Constraints: plain objects the search prunes with and a validator checks on any plan.

    import nnscaler_plugins as nns
    from nnscaler_plugins.search.constraints import MaxTensorParallel, PipelineStages, MemoryLimit, Replicated

    plans = nns.search(model, world_size=16, cluster=nns.cluster("a100-dgx", nodes=2),
                       constraints=[MaxTensorParallel(), PipelineStages({1, 2}), Replicated("lm_head")],
                       example_inputs=batch)
    nns.search.check(plan, graph, [MemoryLimit("40GiB")], cluster=...)   # PlanError naming the constraint

Each constraint answers three questions: does it allow an inter-op `Config` (pruning whole
candidates), does it allow an intra-op choice for one op (pruning per op), and what is wrong with a
finished plan (`violation`, None when it holds). `describe()` is what error messages quote.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, Optional, Union

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.search.space import Axes, Config, config_of

GiB = 1024 ** 3


class Constraint:
    """Base: allows everything. Subclasses override what they restrict."""

    def describe(self) -> str:
        return type(self).__name__

    def allows(self, cfg: Config) -> bool:
        return True

    def allows_op(self, op: OpNode, axes: Axes, batch_label: Optional[str] = None) -> bool:
        return True

    def violation(self, plan: Plan, graph: Graph, estimate: Any = None, cluster: Any = None) -> Optional[str]:
        cfg = config_of(plan, graph)
        return None if self.allows(cfg) else f"the plan has {cfg.describe()}"

    def __repr__(self) -> str:
        return f"<constraint {self.describe()}>"


def parse_bytes(x: Union[int, float, str]) -> float:
    """80e9, "80GB", "80 GiB", "512MiB" -> bytes."""
    if isinstance(x, (int, float)):
        return float(x)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMGT]i?B|B)?\s*", str(x))
    if not m:
        raise ValueError(f"cannot read {x!r} as a memory size; write e.g. 80GiB, 40GB or a number of bytes")
    units = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 1024, "MiB": 1024 ** 2,
             "GiB": 1024 ** 3, "TiB": 1024 ** 4}
    return float(m.group(1)) * units[m.group(2)]


def matches(op: OpNode, target: str) -> bool:
    """An op by name, by module path (the module and everything inside it; * matches one path
    component), or by aten op ("aten.embedding", "embedding")."""
    if target in (op.name, op.op_name, op.short_name, ".".join(op.op_name.split(".")[:2])):
        return True
    path = op.module_path
    if not path:
        return False
    if "*" in target or "?" in target:
        pattern = re.escape(target).replace(r"\*", r"[^.]+").replace(r"\?", ".")
        return re.search(rf"(^|\.){pattern}(\.|$)", path) is not None
    return path == target or path.startswith(target + ".") or path.endswith("." + target) \
        or ("." + target + ".") in ("." + path + ".")


@dataclass(frozen=True)
class SameLayerConfig(Constraint):
    """All repeated layers share one configuration (the search always does; plans may not)."""

    def describe(self) -> str:
        return "all repeated layers share one configuration"

    def violation(self, plan, graph, estimate=None, cluster=None):
        from nnscaler_plugins.plan.layers import layer_groups
        groups = layer_groups(graph)
        if len(groups.layers) < 2:
            return None
        first = [_placement_key(plan.ops[op.name]) for op in groups.layers[0]]
        for i, layer in enumerate(groups.layers[1:], 1):
            keys = [_placement_key(plan.ops[op.name]) for op in layer]
            if len(keys) != len(first):
                continue  # layers of different structure are not repeats
            for a, b, op in zip(first, keys, layer):
                if a != b:
                    return f"layer {i} op {op.where()} is split {b}, layer 0 splits it {a}"
        return None


def _placement_key(p) -> tuple:
    return tuple(p.splits), p.replicate, tuple(sorted(p.blocks.items()))


@dataclass(frozen=True)
class MaxTensorParallel(Constraint):
    """Tensor-parallel degree (pieces of an op not along the batch) <= `degree`; by default the
    cluster's devices per node, so tensor parallelism stays on the fast in-node links."""

    degree: Optional[int] = None
    devices_per_node: Optional[int] = None  # filled in by the search from the cluster

    @property
    def limit(self) -> Optional[int]:
        return self.degree if self.degree is not None else self.devices_per_node

    def describe(self) -> str:
        return (f"tensor-parallel degree <= {self.limit}" if self.degree is not None else
                f"tensor-parallel degree <= devices per node ({self.limit})")

    def bind(self, cluster) -> "MaxTensorParallel":
        return MaxTensorParallel(self.degree, cluster.devices_per_node)

    def allows(self, cfg: Config) -> bool:
        return self.limit is None or cfg.tp <= self.limit

    def allows_op(self, op, axes, batch_label=None) -> bool:
        if self.limit is None:
            return True
        return math.prod(n for l, n in axes if l is not None and l != batch_label) <= self.limit


@dataclass(frozen=True)
class _MaxGroupKernelSplit(Constraint):
    """At most `degree` ways of the split a group kernel of `search/group_kernels.py` takes along its
    own label (the experts op along its experts, attention along its sequence); the subclasses name
    which kernel, label and plan degree."""

    degree: int

    kind: ClassVar[str] = ""        # group_kernels.kind_of
    label: ClassVar[str] = ""       # the group_kernels label name
    config_field: ClassVar[str] = ""  # the Config degree it bounds
    words: ClassVar[str] = ""

    def describe(self) -> str:
        return f"{self.words} degree <= {self.degree}"

    def allows(self, cfg: Config) -> bool:
        return getattr(cfg, self.config_field) <= self.degree

    def allows_op(self, op, axes, batch_label=None) -> bool:
        from nnscaler_plugins.search import group_kernels

        label = getattr(group_kernels, self.label)
        return group_kernels.kind_of(None, op) != self.kind or \
            math.prod(n for l, n in axes if l == label) <= self.degree


@dataclass(frozen=True)
class MaxExpertParallel(_MaxGroupKernelSplit):
    """Mixture-of-experts layers split along their experts (with their tokens) at most `degree`
    ways; 1 keeps every layer's experts whole on each device (data parallelism of the experts)."""

    kind: ClassVar[str] = "experts"
    label: ClassVar[str] = "EXPERTS"
    config_field: ClassVar[str] = "ep"
    words: ClassVar[str] = "expert-parallel"


@dataclass(frozen=True)
class MaxContextParallel(_MaxGroupKernelSplit):
    """Attention split along its sequence at most `degree` ways; 1: no context parallelism."""

    kind: ClassVar[str] = "attention"
    label: ClassVar[str] = "SEQUENCE"
    config_field: ClassVar[str] = "cp"
    words: ClassVar[str] = "context-parallel"


@dataclass(frozen=True)
class Replicated(Constraint):
    """This op (or every op of this module) runs whole: not split along any dim."""

    target: str

    def describe(self) -> str:
        return f"{self.target} replicated (not split)"

    def allows_op(self, op, axes, batch_label=None) -> bool:
        return not matches(op, self.target) or all(l is None for l, _ in axes)

    def violation(self, plan, graph, estimate=None, cluster=None):
        for op in graph.ops:
            if matches(op, self.target) and plan.ops[op.name].splits:
                return f"{op.where()} is split {plan.ops[op.name].splits}"
        return None


@dataclass(frozen=True)
class NotSplit(Constraint):
    """This op (or module) is not split along `dim`: a signature label, a dim of its first output
    (int), or "batch"/"sequence"."""

    target: str
    dim: Union[str, int]

    def describe(self) -> str:
        return f"{self.target} not split along dim {self.dim!r}"

    def _label(self, op: OpNode, sig=None, tags=None) -> Optional[str]:
        if isinstance(self.dim, str) and self.dim not in ("batch", "sequence"):
            return self.dim
        if isinstance(self.dim, str):
            return next((l for l, tag in (tags or {}).get(op.name, {}).items() if tag == self.dim), None)
        if sig is not None and sig.outputs and sig.outputs[0] is not None and -len(sig.outputs[0]) <= self.dim < len(sig.outputs[0]):
            return sig.outputs[0][self.dim]
        return None

    def allows_op(self, op, axes, batch_label=None) -> bool:
        return True  # resolved per op by the search through `label_for`

    def label_for(self, op: OpNode, sig, tags) -> Optional[str]:
        return self._label(op, sig, tags) if matches(op, self.target) else None

    def violation(self, plan, graph, estimate=None, cluster=None):
        from nnscaler_plugins.rules import signature_for
        from nnscaler_plugins.search.dims import tag_labels
        sigs = {op.name: signature_for(graph, op) for op in graph.ops}
        tags = tag_labels(graph, sigs)
        for op in graph.ops:
            label = self.label_for(op, sigs[op.name], tags)
            if label is not None and label in plan.ops[op.name].label_counts():
                return f"{op.where()} is split along {label!r}"
        return None


@dataclass(frozen=True)
class PipelineStages(Constraint):
    """The number of pipeline ranks is one of `counts` (1: no pipeline)."""

    counts: frozenset = field(default_factory=frozenset)

    def __init__(self, counts: Iterable[int]):
        object.__setattr__(self, "counts", frozenset(int(c) for c in counts))

    def describe(self) -> str:
        return f"pipeline stage count in {sorted(self.counts)}"

    def allows(self, cfg: Config) -> bool:
        return cfg.pp in self.counts


@dataclass(frozen=True)
class Schedules(Constraint):
    """Pipeline schedules of these families only ("1f1b", "gpipe", "interleaved", "zero-bubble")."""

    names: frozenset = field(default_factory=frozenset)

    def __init__(self, names: Iterable[str]):
        object.__setattr__(self, "names", frozenset(names if not isinstance(names, str) else [names]))

    def describe(self) -> str:
        return f"schedule family in {sorted(self.names)}"

    def allows(self, cfg: Config) -> bool:
        return cfg.pp == 1 or cfg.schedule in self.names


@dataclass(frozen=True)
class MicroBatchSize(Constraint):
    """Samples per micro-batch (per pipeline of one replica) is one of `sizes`."""

    sizes: frozenset = field(default_factory=frozenset)

    def __init__(self, sizes: Union[int, Iterable[int]]):
        object.__setattr__(self, "sizes", frozenset([int(sizes)] if isinstance(sizes, int) else map(int, sizes)))

    def describe(self) -> str:
        return f"micro-batch size in {sorted(self.sizes)}"

    def allows(self, cfg: Config) -> bool:
        return cfg.micro_batch_size in self.sizes


@dataclass(frozen=True)
class MemoryLimit(Constraint):
    """Peak memory per device <= `limit` (bytes, or a string like "40GiB")."""

    limit: float

    def __init__(self, limit: Union[int, float, str]):
        object.__setattr__(self, "limit", parse_bytes(limit))

    def describe(self) -> str:
        return f"peak memory per device <= {self.limit / GiB:.2f} GiB"

    def violation(self, plan, graph, estimate=None, cluster=None):
        est = estimate if estimate is not None else plan.estimate
        if est is None:
            if cluster is None:
                return "no estimate to check the memory limit against (simulate the plan or pass cluster=)"
            from nnscaler_plugins.search.simulator import simulate
            est = simulate(plan, cluster, graph)
        peak = est.max_memory_bytes if hasattr(est, "max_memory_bytes") else float(est["max_memory_bytes"])
        return None if peak <= self.limit else f"its peak memory is {peak / GiB:.2f} GiB per device"


@dataclass(frozen=True)
class ZeroStages(Constraint):
    """ZeRO stage in `stages` (0: no sharding of model states)."""

    stages: frozenset = field(default_factory=frozenset)

    def __init__(self, stages: Iterable[int]):
        object.__setattr__(self, "stages", frozenset(int(s) for s in stages))

    def describe(self) -> str:
        return f"ZeRO stage in {sorted(self.stages)}"

    def allows(self, cfg: Config) -> bool:
        return cfg.zero in self.stages


@dataclass(frozen=True)
class RecomputeModes(Constraint):
    """Activation recomputation in `modes` ("none", "selective", "full")."""

    modes: frozenset = field(default_factory=frozenset)

    def __init__(self, modes: Iterable[str]):
        object.__setattr__(self, "modes", frozenset([modes] if isinstance(modes, str) else modes))

    def describe(self) -> str:
        return f"recompute in {sorted(self.modes)}"

    def allows(self, cfg: Config) -> bool:
        return cfg.recompute in self.modes


# -- Hugging Face tensor-parallel plans ------------------------------------------------------------------
COLUMN = ("colwise", "colwise_rep", "local_colwise", "packed_colwise")
ROW = ("rowwise", "rowwise_rep", "local_rowwise", "packed_rowwise")


@dataclass(frozen=True)
class HFTensorParallelPlan(Constraint):
    """A Transformers model's own tensor-parallel plan (`config.base_model_tp_plan`, module pattern ->
    "colwise" | "rowwise" | ...), as a prior (`require=False`: the search starts from it) or as a
    constraint (`require=True`: matched linears split only that way when tensor parallelism is used).

    Build it from a model, a config or the dict itself: `HFTensorParallelPlan.of(model)`.
    """

    plan: tuple = ()  # ((pattern, style), ...)
    require: bool = False

    @classmethod
    def of(cls, source: Any, require: bool = False) -> "HFTensorParallelPlan":
        cfg = getattr(source, "config", source)
        tp_plan = source if isinstance(source, Mapping) else getattr(cfg, "base_model_tp_plan", None)
        if not tp_plan:
            raise ValueError(f"{type(source).__name__} has no base_model_tp_plan; pass the plan as a dict "
                             "{module pattern: 'colwise' | 'rowwise'}")
        return cls(tuple(sorted((str(k), str(v)) for k, v in tp_plan.items())), require)

    def describe(self) -> str:
        kinds = {}
        for _, style in self.plan:
            kinds[style] = kinds.get(style, 0) + 1
        return (f"Transformers tensor-parallel plan ({len(self.plan)} patterns) "
                f"{'required' if self.require else 'as a prior'}")

    def style_of(self, op: OpNode) -> Optional[str]:
        """'column' | 'row' | 'replicate' for an op the plan names, else None."""
        for pattern, style in self.plan:
            if matches(op, pattern):
                if style in COLUMN:
                    return "column"
                if style in ROW:
                    return "row"
                if style == "replicate":
                    return "replicate"
        return None

    def violation(self, plan, graph, estimate=None, cluster=None):
        if not self.require:
            return None
        from nnscaler_plugins.rules import signature_for
        from nnscaler_plugins.rules.anchors import matmul_anchor
        for op in graph.ops:
            style = self.style_of(op)
            if style is None:
                continue
            anchor = matmul_anchor(graph, op, signature_for(graph, op))
            if anchor is None:
                continue
            want = {"column": anchor.n, "row": anchor.k, "replicate": None}[style]
            have = [l for l, _ in plan.ops[op.name].splits if l in (anchor.n, anchor.k)]
            if want is None and have:
                return f"{op.where()} should be replicated but is split along {have}"
            if want is not None and have and have != [want]:
                return f"{op.where()} should be {style}-parallel (split {want!r}) but is split along {have}"
        return None


def check(plan: Plan, graph: Graph, constraints: Iterable[Constraint], *, cluster: Any = None,
          estimate: Any = None) -> None:
    """Raise PlanError naming the first constraint `plan` breaks."""
    for c in constraints:
        if isinstance(c, MaxTensorParallel) and c.limit is None and cluster is not None:
            c = c.bind(cluster)
        problem = c.violation(plan, graph, estimate, cluster)
        if problem:
            raise PlanError(f"plan breaks the constraint '{c.describe()}': {problem}")
