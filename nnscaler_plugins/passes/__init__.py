"""Parallelizations as passes over a plan's typed mesh: what every strategy, built-in or not, and
the search compose.

    par = Parallelization(builder)          # per-op choices along the mesh's axes
    apply_pp(par, schedule="1f1b")          # stages on the "pp" axis
    tp = apply_tp(par)                      # Megatron tensor parallelism on "tp", found from the rules
    apply_sp(par)                           # its sequence-parallel norms and residual adds
    apply_cp(par, tp_choices=tp)            # the sequence split on "cp"
    par.place()                             # op_trans / op_assign for every op, at its mesh coordinates
    order(par, "1f1b")                      # op_order of the stages
    apply_recompute(builder, "selective")
    apply_batch_statistics(builder)         # reductions over the batch made whole across replicas

Each pass decides one axis (or one knob) and knows nothing of the others; `Parallelization.place`
composes them. A third-party strategy uses these names exactly as the built-in ones do.
"""
from nnscaler_plugins.passes.batch_statistics import apply_batch_statistics, with_batch_statistics
from nnscaler_plugins.passes.context_parallel import apply_cp, attention_ops, check_context_parallel, sequence_choices
from nnscaler_plugins.passes.expert_parallel import (
    EXPERT_LABEL,
    WIDTH_LABEL,
    apply_batch_split,
    apply_ep,
    batch_choices,
    check_experts,
    is_experts_op,
)
from nnscaler_plugins.passes.parallelization import AxisSplit, Parallelization, Stage
from nnscaler_plugins.passes.pipeline import DEFAULT_SCHEDULE, apply_pp, order
from nnscaler_plugins.passes.recompute import apply_recompute
from nnscaler_plugins.passes.sequence_parallel import apply_sp
from nnscaler_plugins.passes.tensor_parallel import Choice, TensorParallelPropagation, apply_tp
from nnscaler_plugins.passes.zero import apply_zero

__all__ = ["Parallelization", "AxisSplit", "Stage", "apply_tp", "apply_sp", "apply_cp", "apply_ep", "apply_batch_split",
           "apply_pp", "order", "apply_zero", "apply_recompute", "apply_batch_statistics", "with_batch_statistics",
           "TensorParallelPropagation", "Choice", "batch_choices", "check_experts", "is_experts_op", "attention_ops",
           "check_context_parallel", "sequence_choices", "EXPERT_LABEL", "WIDTH_LABEL", "DEFAULT_SCHEDULE"]
