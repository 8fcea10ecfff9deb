"""Expert parallelism: each MoE layer's experts split over the mesh's "ep" axis, optionally each
expert's width over its "etp" axis; and data parallelism inside the unit for the dense part.

The unit of `ep x etp` devices runs the dense part of the model as data parallelism inside the unit
(every op split along the batch, its weights whole on each device), and each mixture-of-experts
layer -- captured as one op, `capture/experts.py`, whichever calling convention the model uses
(tokens with expert ids and routing weights, or rows sorted by expert with counts) -- split along
its `t` label: a device keeps its
own tokens and its share of the experts, and the kernel moves the rows to the experts chosen for
them and back by all-to-all. With `etp` (Megatron's expert tensor parallelism), each share of the
experts is further cut along every expert's intermediate width over `etp` consecutive devices
(the op's `f` label): they see the same tokens (gathered from their batch pieces), each computes
a partial sum of their outputs, and the lowering adds the pieces up -- so experts / ep of them and
1/etp of each sit on a device, where a model with few large experts cannot spread them by ep alone. The plan's `dp` copies of the unit are expert-data-parallel: an
expert's gradient is reduced only among the `dp` replicas that hold that expert, a dense weight's
among all `ep * dp` devices (the unit's batch split gives partial sums the lowering reduces inside
the unit). ZeRO (`zero=`) shards what each device holds across its `dp` replicas: expert state
among the replicas of the same experts only.

Why the batch split is found by propagation and not by naming inputs: the batch dim is followed
from the model's inputs through every op's dimension rule (a reshape of [B, S, H] into [B*S, H]
keeps it, a loss reduces over it), so models the strategy was never shown are planned the same way.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from nnscaler_plugins.capture.autograd_functions import FunctionTarget
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.kernels.experts_module import ExpertsCall, SortedExpertsCall
from nnscaler_plugins.passes.parallelization import Parallelization
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder
from nnscaler_plugins.rules import op_call
from nnscaler_plugins.rules.experts_op import experts_parts

EXPERT_LABEL = "t"  # rules/experts_op.py: tokens and experts, split together
WIDTH_LABEL = "f"  # rules/experts_op.py: each expert's intermediate width


def is_experts_op(op: OpHandle) -> bool:
    """A mixture-of-experts layer captured as one op (either calling convention)."""
    t = op.node.target
    return isinstance(t, FunctionTarget) and t.cls in (ExpertsCall, SortedExpertsCall)


def check_experts(builder: PlanBuilder, ep: Optional[int] = None, etp: int = 1) -> list[OpHandle]:
    """The MoE layers of the graph, each checked to split into `ep` shares of experts and each
    expert's width into `etp` slices; refused by name otherwise."""
    ep = builder.unit_size // etp if ep is None else ep
    layers = [op for op in builder.ops if is_experts_op(op)]
    if not layers:
        raise PlanError("strategy 'ep': the model has no recognized mixture-of-experts layers (a module whose "
                        "parameters are stacked along a leading dim of its experts, called with tokens, expert "
                        "ids and routing weights, or with rows sorted by expert and the rows per expert); use "
                        "'dp', 'tp' or 'hybrid' for it")
    graph = builder.graph
    for op in layers:
        x, weights = experts_parts(op_call(graph, op.node))
        if ep > 1 and EXPERT_LABEL not in op.signature.splittable():
            raise PlanError(f"strategy 'ep': ep={ep} splits each layer's experts, and this experts module "
                            f"({op.node.module_type or 'module'}) cannot be split by experts: "
                            + _why_whole(weights) + "; use ep=1 (its experts then run whole on each device, "
                            "and 'dp', 'tp', 'zero3' and pipelines train it exactly)", op=op.name, where=op.where())
        experts = weights[0].shape[0]
        if experts % ep:
            raise PlanError(f"strategy 'ep': ep={ep} does not divide the {experts} experts of this layer; choose an "
                            f"ep among the divisors of {experts}", op=op.name, where=op.where())
        if x.shape[0] % ep:
            raise PlanError(f"strategy 'ep': the layer's {x.shape[0]} tokens per replica do not split into ep={ep} "
                            "devices; give each data-parallel replica a batch divisible by ep", op=op.name,
                            where=op.where())
        if etp > 1:
            check_width(graph, op, etp)
    return layers


def _why_whole(weights: Sequence[Any]) -> str:
    if not weights or len({w.shape[0] for w in weights}) != 1 or any(w.ndim < 2 for w in weights):
        return ("it holds its experts as separate modules (a ModuleList), and a share of them is not a slice of "
                "stacked weights; stack them as parameters of shape (experts, ...) to split them")
    return ("running it on a piece of its rows, or on a share of its experts, does not give the same rows (probed "
            "by capture/experts_probe.py: its forward mixes rows or experts)")


def check_width(graph: Any, op: OpHandle, etp: int) -> None:
    """Refuses, by name, an experts layer whose width cannot be split `etp` ways exactly."""
    sig = op.signature
    if WIDTH_LABEL not in sig.labels():
        raise PlanError(f"strategy 'ep': etp={etp} needs each expert's intermediate width split, and this experts "
                        "module's forward does not add up from slices of its width (probed by "
                        "rules/experts_intermediate.py; e.g. a bias after the down projection, a norm over the width "
                        "or interleaved gate and up rows); use etp=1 (experts whole, split by ep)",
                        op=op.name, where=op.where())
    if not op.splittable(WIDTH_LABEL, etp):
        widths = sorted({graph.meta(op.node.inputs[i]).shape[labels.index(WIDTH_LABEL)]
                         // sig.blocks.get((WIDTH_LABEL, i), 1)
                         for i, labels in enumerate(sig.inputs) if labels and WIDTH_LABEL in labels})
        raise PlanError(f"strategy 'ep': etp={etp} does not divide each expert's intermediate width "
                        f"({', '.join(map(str, widths))}); choose an etp among its divisors",
                        op=op.name, where=op.where())


def mutates_input(op: OpHandle) -> bool:
    """An in-place op (`copy_` into a slice of a fresh buffer, as DeepSeek-V3's attention writes its
    keys). Split along the batch, each piece would update a local chunk of the view while readers of
    the buffer see it whole and unwritten, so the strategy keeps these whole."""
    parts = op.node.op_name.split(".")
    return len(parts) >= 2 and parts[-2].endswith("_") and not parts[-2].startswith("_")


def batch_choices(builder: PlanBuilder, n: Optional[int] = None) -> dict[str, Optional[str]]:
    """For every op, the label carrying the batch dim of its inputs (split `n` ways, default the
    unit's size), or None (whole).

    Layouts are tracked per value as the split dim (None: whole, a partial sum counts as whole).
    The model's inputs are split along dim 0 when it has the first input's batch size.
    """
    n = builder.unit_size if n is None else n
    graph = builder.graph
    inputs = [v for v in graph.values.values() if v.kind == "input" and v.meta is not None and v.meta.ndim >= 1]
    batch = inputs[0].meta.shape[0] if inputs else None
    split_dim: dict[str, Optional[int]] = {v.name: (0 if v.meta.shape[0] == batch else None) for v in inputs}
    choices: dict[str, Optional[str]] = {}
    for op in builder.ops:
        sig = op.signature
        label: Optional[str] = None
        if is_experts_op(op):
            label = EXPERT_LABEL
        elif mutates_input(op):
            pass  # whole: a piece would write into a chunk copy, not into the tensor its views share
        else:
            for i, name in enumerate(op.node.inputs):
                d = split_dim.get(name)
                labs = sig.inputs[i] if i < len(sig.inputs) else None
                if d is None or labs is None or d >= len(labs):
                    continue
                cand = labs[d]
                if not sig.is_frozen(cand) and op.splittable(cand, n):
                    label = cand
                    break
        choices[op.name] = label
        for j, out in enumerate(op.node.outputs):
            if out is None:
                continue
            labs = sig.outputs[j] if j < len(sig.outputs) else None
            split_dim[out] = (labs.index(label) if label is not None and labs and label in labs else None)
    return choices


def check_capacity(capacity_factor: Any) -> None:
    """`capacity_factor=` (Megatron's): each expert takes at most ceil(factor x rows / experts) of a
    device's (token, choice) rows, the rest dropped; None (the default) drops nothing."""
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise PlanError(f"strategy 'ep': capacity_factor={capacity_factor!r} must be a positive number (or None: "
                        "no token dropped)")


def apply_ep(par: Parallelization, capacity_factor: Any = None) -> list[OpHandle]:
    """Each MoE layer (captured as one op, `capture/experts.py`) split along its experts, with their
    tokens, over the mesh's "ep" axis, and along each expert's width over "etp"; the kernel moves
    the rows to the experts chosen for them and back by all-to-all. Checked first: every layer's
    experts and tokens divide by ep, its width by etp (`check_experts`). Records the capacity
    factor and that experts are captured as one op in the plan's knobs; returns the layers."""
    builder = par.builder
    ep, etp = par.degree("ep"), par.degree("etp")
    check_capacity(capacity_factor)
    builder.set_knobs(experts_as_one_op=True, capacity_factor=capacity_factor)
    layers = check_experts(builder, ep, etp)
    for op in layers:
        if ep > 1:
            par.split(op, "ep", EXPERT_LABEL)
        if etp > 1:
            par.split(op, "etp", WIDTH_LABEL)
    return layers


def apply_batch_split(par: Parallelization, axes: Sequence[str], skip_experts: bool = True) -> dict[str, Optional[str]]:
    """Data parallelism inside the unit: every op split along the label that carries the batch
    (`batch_choices`, followed from the inputs through the ops' rules) over `axes` of each op's
    view; an op already split along an axis keeps that. Experts ops are left to `apply_ep`."""
    builder = par.builder
    ops = [op for op in builder.ops if not (skip_experts and is_experts_op(op))]
    if not ops:
        return {}
    view = dict(par.view_of(ops[0]))
    n = math.prod(view.get(a, 1) for a in axes)
    if n == 1:
        return {}
    choices = batch_choices(builder, n)
    for op in ops:
        label = choices.get(op.name)
        if label is None:
            continue
        taken = [par.choice(op, a) for a in view if a not in axes]
        if any(t is not None and (t.label == label or t.label in op.signature.comm_labels) for t in taken):
            # another axis splits this dim, or a group-aware piece (vocabulary-parallel cross-entropy)
            # communicates along its label: the pieces are copied across these axes instead
            continue
        par.split(op, [a for a in axes if a in view], label)
    return choices
