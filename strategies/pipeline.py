"""Pipeline parallelism alone or with tensor and data parallelism (3-D plans), the interlaced
pipeline, and the `megatron` strategy that writes down a published Megatron-LM configuration.

Each is a composition of the passes over the mesh {"dp", "pp", "tp"}: `apply_pp` cuts the layer
stack into `pp * virtual_stages` stages (stage k on pipeline rank k % pp), `apply_tp` gives every
stage the Megatron tensor parallelism the `tp` strategy gives a whole model over its own devices,
`order` writes the schedule. The result is an ordinary plan: saved, checked and explained like any.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import (
    DEFAULT_SCHEDULE,
    Parallelization,
    apply_batch_statistics,
    apply_cp,
    apply_pp,
    apply_recompute,
    apply_sp,
    apply_tp,
    order,
)
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder

from .expert_parallel import MESH as EP_MESH
from .expert_parallel import expert_parallel

#: pp stages of tp devices (tp default 1); pp takes the world unless dp= says otherwise.
MESH = MeshLayout(("dp", "pp", "tp"), fill=("pp", "dp"))
#: As Megatron's arguments: pp, cp and tp default to 1, dp is what is left; tp innermost, then cp
#: (Megatron's rank order tp-cp-dp-pp: a tensor-parallel group's devices are neighbours, in one node).
#: With ep= / etp= (a mixture-of-experts model), the experts' layout of strategies/expert_parallel.py:
#: dp x pp x ep x etp, the dense part's tp laid over the ep x etp devices (Megatron's parallel folding).
MEGATRON_MESH = MeshLayout(("dp", "pp", "cp", "tp"), fill=("dp", "pp"), variant=(("ep", "etp"), EP_MESH))
#: Megatron-LM's names for the context-parallel attention (--cp-comm-type) and ours.
CP_COMM = {"p2p": "ring", "a2a": "ulysses", "allgather": "allgather", "ring": "ring", "ulysses": "ulysses"}


def pipeline(builder: PlanBuilder, *, schedule: Union[str, Callable[..., Any]] = DEFAULT_SCHEDULE,
             virtual_stages: int = 1, recompute: Any = None, sequence_parallel: bool = False,
             batch_statistics: Optional[str] = None, **options: Any) -> None:
    """Stages of equal layer counts on pp device groups of tp devices each, ordered by `schedule`.
    The loss's nonlinear statistics over the batch (a router loss) are whole only without
    micro-batches (see `passes.apply_batch_statistics`)."""
    par = Parallelization(builder, MESH, options)
    apply_pp(par, schedule, virtual_stages, always=True)
    tensor_parallel(par, sequence_parallel)
    par.place()
    apply_recompute(builder, recompute)
    order(par, schedule)
    apply_batch_statistics(builder, batch_statistics)


def tensor_parallel(par: Parallelization, sequence_parallel: bool) -> None:
    """Megatron tensor parallelism in every stage, with its sequence-parallel norms and residual adds
    when asked (recorded in the plan's knobs)."""
    apply_tp(par)
    if sequence_parallel:
        apply_sp(par)
        par.builder.set_knobs(sequence_parallel=True)


def interlaced_pipeline(builder: PlanBuilder, *, recompute: Any = None, batch_statistics: Optional[str] = None,
                        **options: Any) -> None:
    """The interlaced pipeline: the layers in pp stages (tp devices each) while what comes before
    them (a large embedding) and after them (the LM head and its loss) are tensor-parallel across
    every device of the unit, as two shared stages the schedule interlaces into the 1F1B order."""
    par = Parallelization(builder, MESH, options)
    apply_pp(par, interlaced=True)
    apply_tp(par)
    par.place()
    apply_recompute(builder, recompute)
    order(par)
    apply_batch_statistics(builder, batch_statistics)


def named(schedule: str) -> Callable[..., None]:
    """The pipeline strategy of one built-in schedule (`interleaved`: 2 chunks per rank by default)."""

    def apply(builder: PlanBuilder, **options: Any) -> None:
        options.pop("schedule", None)
        if schedule == "interleaved":
            options.setdefault("virtual_stages", 2)
        pipeline(builder, schedule=schedule, **options)

    apply.__name__ = schedule.replace("-", "_")
    apply.__doc__ = f"Pipeline with the {schedule!r} schedule; options pp, tp, dp, micro_batches" + (
        ", virtual_stages (default 2)" if schedule == "interleaved" else "") + "."
    return apply


def megatron(builder: PlanBuilder, *, schedule: Optional[str] = None, virtual_stages: int = 1,
             sequence_parallel: bool = False, recompute: Optional[str] = None,
             batch_statistics: Optional[str] = None, cp_comm: str = "p2p", balance: Optional[bool] = None,
             **options: Any) -> None:
    """A Megatron-LM configuration written down: tp x cp x pp x dp, the schedule (1F1B, or
    interleaved with `virtual_stages` > 1), micro-batches (`micro_batches` or `micro_batch_size`,
    resolved by `nns.plan`), `sequence_parallel` (the layer norms, dropouts and residual adds split
    along the sequence dim, `passes.apply_sp`), `recompute` ("full" | "selective"), and with cp > 1
    the sequence split over cp devices (`passes.apply_cp`) with `cp_comm` as Megatron's
    --cp-comm-type names it ("p2p": ring, "a2a": all-to-all / Ulysses, "allgather") and causal load
    balancing unless `balance=False`; recorded in the plan's knobs for the cost model. With `ep=` /
    `etp=` (Megatron's --expert-model-parallel-size / --expert-tensor-parallel-size) the experts are
    split as strategy "ep" splits them, `capacity_factor` as Megatron's --moe-expert-capacity-factor."""
    if recompute not in (None, "none", "full", "selective"):
        raise PlanError(f"megatron: recompute must be 'full', 'selective' or None (got {recompute!r})")
    if megatron_experts(options):
        _megatron_experts(builder, schedule, int(virtual_stages), sequence_parallel, recompute, batch_statistics,
                          options)
        return
    options.pop("capacity_factor", None)
    schedule = schedule or ("interleaved" if int(virtual_stages) > 1 else DEFAULT_SCHEDULE)
    par = Parallelization(builder, MEGATRON_MESH, options)
    if par.degree("cp") > 1:
        _megatron_cp(par, schedule, int(virtual_stages), sequence_parallel, recompute, batch_statistics,
                     cp_comm, balance)
        return
    if par.pp > 1:
        pipeline(builder, schedule=schedule, virtual_stages=virtual_stages, recompute=recompute,
                 sequence_parallel=sequence_parallel, batch_statistics=batch_statistics)
        return
    if int(virtual_stages) > 1:
        raise PlanError("megatron: virtual_stages needs pp > 1")
    tensor_parallel(par, sequence_parallel)
    par.place()
    apply_recompute(builder, recompute)
    apply_batch_statistics(builder, batch_statistics)


def megatron_experts(options: Any) -> bool:
    """Whether megatron's options split experts (ep= or etp= above 1): the experts' layout then."""
    return any(isinstance(options.get(n), int) and options.get(n) > 1 for n in ("ep", "etp"))


def _megatron_experts(builder: PlanBuilder, schedule: Optional[str], virtual_stages: int, sequence_parallel: bool,
                      recompute: Optional[str], batch_statistics: Optional[str], options: dict) -> None:
    """megatron with ep= / etp=: the passes of strategy "ep" (experts over ep x etp, the dense part
    tensor-parallel over tp of those devices, pp stages, dp replicas that are expert-data-parallel)."""
    if virtual_stages > 1 or schedule == "interleaved":
        raise PlanError("megatron: the interleaved schedule (virtual_stages > 1) with ep= / etp= is not supported yet; "
                        "use the 1F1B schedule (virtual_stages=1) with experts, or strategy 'interleaved' without them")
    if sequence_parallel:
        raise PlanError("megatron: sequence_parallel=True with ep= / etp= is not supported yet; use "
                        "sequence_parallel=False with experts")
    expert_parallel(builder, schedule=schedule, recompute=recompute, batch_statistics=batch_statistics, **options)


# Read by the entry points before capture (capture/experts.py: wants_experts_as_one_op): the experts
# are one op only where the options split them.
megatron.experts_as_one_op = megatron_experts  # type: ignore[attr-defined]


def _megatron_cp(par: Parallelization, schedule: str, virtual_stages: int, sequence_parallel: bool,
                 recompute: Optional[str], batch_statistics: Optional[str], cp_comm: str,
                 balance: Optional[bool]) -> None:
    """megatron with cp > 1: the passes of the `cp` strategy on Megatron's rank order (each stage's
    tensor parallelism inside its sequence chunk's group, then the sequence split over cp)."""
    if str(cp_comm) not in CP_COMM:
        raise PlanError(f"megatron: cp_comm={cp_comm!r}: use one of {', '.join(CP_COMM)} (Megatron's "
                        "--cp-comm-type p2p, a2a or allgather)")
    if sequence_parallel:
        raise PlanError(f"megatron: sequence_parallel=True with cp={par.degree('cp')} is not supported yet (both "
                        "split the sequence dim and their composition is not checked); use "
                        "sequence_parallel=False with cp, or cp=1")
    builder = par.builder
    if par.pp == 1 and virtual_stages > 1:
        raise PlanError("megatron: virtual_stages needs pp > 1")
    apply_pp(par, schedule, virtual_stages)
    tp = apply_tp(par, check="each" if par.pp == 1 else "any")
    apply_cp(par, CP_COMM[str(cp_comm)], balance, tp)
    par.place()
    apply_recompute(builder, recompute)
    order(par, schedule)
    apply_batch_statistics(builder, batch_statistics)
