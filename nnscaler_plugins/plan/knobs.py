"""A plan's typed knobs: how it trains and communicates, beyond which op runs where.

Lowering, the op rules, the search's pricing and the runtime read these fields, never loose option
names: `plan.knobs.cp_comm`, `plan.knobs.tp_comm_overlap`, `plan.knobs.collective_timeout_s`. A
strategy sets them through `PlanBuilder.set_knobs(...)`; the options every strategy takes that are
knobs (`KNOB_OPTIONS`) are set by `nns.plan` itself. An unknown name is refused with the name meant.

The ZeRO stage, precision, offload and micro-batches stay fields of the Plan itself (they were
typed from the start); everything that used to travel in `plan.options` is here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from nnscaler_plugins.errors import PlanError, refuse_unknown

RECOMPUTE_MODES = ("none", "full", "selective")  # or a module class name / module paths (recorded as "custom")
CP_COMMS = ("ring", "allgather", "ulysses")
ON_NONFINITE = ("raise", "skip", "ignore")
BATCH_STATISTICS = ("global", "local")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile's backends the runtime is tested with
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's float8 training recipes
# How a plan's forward runs: "auto" captures it and runs generated code where it can, the model's own
# forward eagerly where capture fails and the plan keeps whole layers on each device; "captured" refuses
# a model capture cannot take; "eager" never captures (runtime/eager_executor.py).
EXECUTORS = ("auto", "captured", "eager")


@dataclass(frozen=True)
class Knobs:
    """Every field has a default that means "as before this knob existed"."""

    # -- how the plan computes ---------------------------------------------------------------------------
    recompute: str = "none"  # the recompute mode the strategy applied (its groups are on the ops)
    sequence_parallel: bool = False  # norms, dropouts and residual adds split along the sequence between tp matmuls
    batch_statistics: str = "global"  # "global": reductions over the batch the loss uses nonlinearly made whole
    # op name -> (how: "sum" | "mean", input holding the batch's elements): the reductions found, made
    # whole across data-parallel replicas by the lowering (empty with "local" or when there are none)
    batch_statistic_ops: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    cp_comm: str = "ring"  # how attention pieces meet their keys under context parallelism
    capacity_factor: Optional[float] = None  # expert capacity (None: every token reaches its experts)
    experts_as_one_op: bool = False  # mixture-of-experts layers captured as one op (ep plans)
    # -- overlap of communication with compute (None: as the cluster's software stack does) -------------
    tp_comm_overlap: Optional[bool] = None
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None
    overlap_p2p: Optional[bool] = None
    # -- how it runs ---------------------------------------------------------------------------------------
    compile: bool = False  # the per-rank program under torch.compile (compiled per region, see codegen/regions.py)
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager": no code generated, for debugging)
    # -- float8 training (precision="fp8"; see kernels/float8.py) -------------------------------------------
    fp8_recipe: str = "tensorwise"  # torchao's scaling recipe: tensorwise, rowwise or rowwise_with_gw_hp
    fp8_emulate: bool = False  # float8 matmuls emulated in high precision (a CPU, a GPU without fp8 units)
    fp8_linears: tuple[str, ...] = ()  # module paths (fnmatch patterns) to convert; () is torchao's default
    fp8_skip: tuple[str, ...] = ()  # module paths containing one of these stay in bf16 (torchao's filter_fqns)
    # ZeRO-3 all-gathers the weights of float8 linears as float8 (one global-amax scale per weight, a
    # quarter of fp32's bytes); None: wherever it applies (tensorwise scaling, ZeRO-3 with replicas)
    fp8_all_gather: Optional[bool] = None
    collective_timeout_s: Optional[float] = None  # a hung collective is reported after this (None: the backend's)
    report_dir: Optional[str] = None  # where hang reports are written as JSON (None: ./nnscaler_reports)
    on_nonfinite: str = "raise"  # a non-finite loss or gradient: raise NonFiniteError, skip the step, or ignore
    executor: str = "auto"  # see EXECUTORS; a plan that runs eagerly says "eager" and why in eager_reason
    eager_reason: str = ""  # why the model's own forward runs (capture's error, or executor="eager" asked)
    # -- provenance ---------------------------------------------------------------------------------------
    cluster: Optional[str] = None  # the cluster preset a searched plan was found for

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_statistic_ops",
                           {str(k): (str(v[0]), int(v[1])) for k, v in dict(self.batch_statistic_ops).items()})
        for name in ("fp8_linears", "fp8_skip"):  # lists from a plan file or a config
            v = getattr(self, name)
            if isinstance(v, str):
                v = (v,)
            if isinstance(v, (list, tuple)):
                object.__setattr__(self, name, tuple(v))
        check(self)

    def replace(self, **changes: Any) -> "Knobs":
        """A copy with `changes` (names checked, with the name meant for a misspelt one)."""
        refuse_unknown_knobs(changes)
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """Only the knobs that differ from their defaults (a plan file stays short and readable)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if v != default:
                out[f.name] = ({k: list(x) for k, x in v.items()} if f.name == "batch_statistic_ops"
                               else list(v) if isinstance(v, tuple) else v)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "the plan's knobs") -> "Knobs":
        if not isinstance(d, Mapping):
            raise PlanError(f"{where} must be an object, not {type(d).__name__}")
        refuse_unknown_knobs(d, where)
        from nnscaler_plugins.plan import fields

        values = dict(d)
        if "batch_statistic_ops" in values:
            at = f"{where}: batch_statistic_ops"

            def entry(v: Any, field: str) -> tuple:
                kind, n = fields.sequence(v, field, length=2)
                return fields.text(kind, f"{field}[0]"), fields.integer(n, f"{field}[1]")
            values["batch_statistic_ops"] = {k: tuple(entry(v, f"{at}[{k!r}]"))
                                             for k, v in fields.mapping(values["batch_statistic_ops"], at).items()}
        return cls(**values)


KNOB_NAMES = tuple(f.name for f in dataclasses.fields(Knobs))
#: Options every strategy takes (besides its own) that set a knob directly.
KNOB_OPTIONS = frozenset({"tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "overlap_p2p", "compile",
                          "compile_backend", "fp8_recipe", "fp8_emulate", "fp8_linears", "fp8_skip", "fp8_all_gather",
                          "collective_timeout_s", "on_nonfinite", "report_dir", "executor"})


def refuse_unknown_knobs(names: Mapping[str, Any], where: str = "") -> None:
    refuse_unknown(names, KNOB_NAMES, "knob", where)


def check(k: Knobs) -> None:
    """Each knob's values, refused before any process starts."""
    if k.cp_comm not in CP_COMMS:
        raise PlanError(f"cp_comm={k.cp_comm!r}: use one of {', '.join(CP_COMMS)}")
    if k.on_nonfinite not in ON_NONFINITE:
        raise PlanError(f"on_nonfinite={k.on_nonfinite!r}: use 'raise' (stop with NonFiniteError before any weight "
                        "changes), 'skip' (skip the step on every rank) or 'ignore'")
    if k.executor not in EXECUTORS:
        raise PlanError(f"executor={k.executor!r}: use 'auto' (captured where capture works, else the model's own "
                        "forward eagerly), 'captured' (refuse what capture cannot take) or 'eager' (never capture)")
    if not isinstance(k.eager_reason, str):
        raise PlanError(f"eager_reason={k.eager_reason!r} must be a string")
    if k.batch_statistics not in BATCH_STATISTICS:
        raise PlanError(f"batch_statistics={k.batch_statistics!r}; use 'global' or 'local'")
    if k.compile_backend not in COMPILE_BACKENDS:
        raise PlanError(f"compile_backend={k.compile_backend!r}: use one of {', '.join(COMPILE_BACKENDS)}")
    if k.fp8_recipe not in FP8_RECIPES:
        raise PlanError(f"fp8_recipe={k.fp8_recipe!r}: use one of {', '.join(FP8_RECIPES)} (torchao's float8 "
                        "training recipes)")
    for name in ("fp8_linears", "fp8_skip"):
        v = getattr(k, name)
        if not isinstance(v, tuple) or not all(isinstance(x, str) and x for x in v):
            raise PlanError(f"{name}={v!r} must be a list of module paths (fnmatch patterns such as "
                            "'model.layers.*.mlp.*')")
    for name in ("sequence_parallel", "experts_as_one_op", "compile", "fp8_emulate"):
        if not isinstance(getattr(k, name), bool):
            raise PlanError(f"{name}={getattr(k, name)!r} must be True or False")
    for name in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "overlap_p2p", "fp8_all_gather"):
        v = getattr(k, name)
        if v is not None and not isinstance(v, bool):
            raise PlanError(f"{name}={v!r} must be True, False or None ("
                            + ("wherever it applies" if name == "fp8_all_gather" else "the cluster's default") + ")")
    if k.fp8_all_gather and k.fp8_recipe != "tensorwise":
        raise PlanError(f"fp8_all_gather=True with fp8_recipe={k.fp8_recipe!r}: a float8 all-gather needs one scale "
                        "per weight (tensorwise scaling; torchao offers it for tensorwise only). Use "
                        "fp8_recipe='tensorwise', or leave fp8_all_gather unset to gather these weights in bf16")
    t = k.collective_timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isinf(t)):
        raise PlanError(f"collective_timeout_s={t!r} must be a positive number of seconds (or None for the "
                        "backend's own timeout)")
    if k.report_dir is not None and (not isinstance(k.report_dir, str) or not k.report_dir):
        raise PlanError(f"report_dir={k.report_dir!r} must be a folder path (or None for ./nnscaler_reports)")
    c = k.capacity_factor
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
        raise PlanError(f"capacity_factor={c!r} must be a positive number (or None: no capacity limit)")
    if not isinstance(k.recompute, str) or not k.recompute:
        raise PlanError(f"recompute={k.recompute!r} must name the recompute mode")


def from_v1_options(options: Mapping[str, Any]) -> tuple[Knobs, dict[str, Any], list[str]]:
    """Knobs from a version-1 plan's `options` dict: (knobs, the options left, what was moved), for
    loading plan files written before knobs were typed."""
    moved, rest, values = [], {}, {}
    for k, v in options.items():
        if k == "batch_statistics":
            if v == "local":
                values["batch_statistics"] = "local"
            elif isinstance(v, Mapping):
                values["batch_statistic_ops"] = {op: tuple(x) for op, x in v.items()}
            moved.append(k)
        elif k == "recompute":
            values["recompute"] = "none" if v in (None, False) else ("full" if v is True else str(v))
            moved.append(k)
        elif k in KNOB_NAMES and k not in ("batch_statistic_ops",):
            values[k] = v
            moved.append(k)
        else:
            rest[k] = v
    return Knobs(**values), rest, moved
