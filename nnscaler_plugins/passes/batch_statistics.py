"""Statistics over the batch: what data-parallel replicas must combine to compute what one device does.

Two kinds. Batch norm in training normalizes with the mean and variance over the batch and updates
its running statistics from them: every replica must take them over the whole global batch (the
lowering replaces the op with `kernels.batch_norm_statistics`, SyncBatchNorm's arithmetic), or
each replica trains another model, as DDP without SyncBatchNorm does. And reductions over the
batch that the loss uses nonlinearly:

Each data-parallel replica runs the plan's unit on its share of the batch, and the replicas' losses
are weighted by their items before gradients are averaged. A reduction over the batch that reaches
the loss only through sums and scalings (a mean cross-entropy, `aux * coef` added to it) is exact
that way. One that meets a nonlinear op first -- the router load-balancing loss multiplies the
fraction of tokens sent to each expert by the mean router probability, both means over every
token -- is not, and Hugging Face's own loss under DDP or gradient accumulation differs from one
device's on the whole batch for that reason. The lowering makes the reductions found here whole
across the replicas (`kernels.replica_statistics`), so every replica reads the whole batch's value.

Strategies record both in the plan's knobs (`apply_batch_statistics`, the pass every built-in
strategy ends with: "global", the default, finds and records them; "local" keeps each replica's
own, as Hugging Face under DDP and DDP without SyncBatchNorm do); a plan that does not say (one from `nns.search`, saved before, or
made by a strategy that does not look) gets them here before it is lowered
(`with_batch_statistics`), so no plan with replicas or micro-batches runs a router loss silently
per replica. The batch dim is followed from the model's inputs through every op's dimension rule,
as the strategies find it, so nothing depends on the model's module names.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.kernels.batch_norm_statistics import KERNELS as BATCH_NORM_KERNELS
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder
from nnscaler_plugins.outputs import loss_position

#: Ops the loss is linear in (each input listed is entered): views, copies, sums and scalings.
_THROUGH_ALL = ("aten.view.", "aten.reshape.", "aten._unsafe_view.", "aten.clone.", "aten.alias.", "aten._to_copy.",
                "aten.to.", "aten.squeeze.", "aten.unsqueeze.", "aten.add.", "aten.sub.", "aten.neg.",
                "aten.sum.", "aten.mean.", "aten.select.", "aten.slice.", "aten.expand.", "aten.contiguous.",
                "aten.add_.", "aten.sub_.", "aten.neg_.")
_SCALINGS = ("aten.mul.", "aten.div.", "aten.mul_.", "aten.div_.")  # linear in an input the other does not scale
_SUMS = ("aten.sum.",)
_MEANS = ("aten.mean.",)
#: Ops that keep the batch whole and count over it: their pieces' counts add up (histograms).
_COUNTS = ("aten.histc.", "aten.bincount.")
#: Rows of the batch added into a buffer at indices (a histogram or per-expert sum when the buffer
#: starts at zero, which `batch_statistics` checks).
_SCATTER_SUMS = ("aten.scatter_add.", "aten.scatter_add_.", "aten.index_add.", "aten.index_add_.")
_ZEROS = ("aten.zeros.", "aten.new_zeros.", "aten.zeros_like.")
#: Ops that flatten or repeat rows, the batch staying outermost.
_ROWS_KEPT = ("aten.reshape.", "aten.view.", "aten._unsafe_view.", "aten.flatten.", "aten.repeat_interleave.")
#: Batch norm: in training it normalizes with the mean and variance over the batch (and the spatial
#: dims) and updates its running statistics from them; the kernels replacing it on each replica
#: (`kernels.batch_norm_statistics.KERNELS`) take them over the whole batch.
_BATCH_NORMS = ("aten.batch_norm.", "aten.native_batch_norm.", "aten._native_batch_norm_legit.",
                "aten._native_batch_norm_legit_functional.")


def batch_norm_in_training(op: OpHandle) -> bool:
    """Whether the op is a batch norm that takes its statistics from its input (training mode)."""
    node = op.node
    if not node.op_name.startswith(_BATCH_NORMS):
        return False
    at = 3 if node.op_name.startswith("aten._native_batch_norm_legit.no_stats") else 5
    training = node.args[at] if len(node.args) > at else node.kwargs.get("training", False)
    return bool(training)


def _batch_reductions(builder: PlanBuilder) -> tuple[dict[str, tuple[OpHandle, int]], set[str], dict[str, OpHandle]]:
    """Ops reducing over the batch dim (each with the input that carries the batch), the values
    that depend on the data inputs, and the batch norms in training whose input carries the batch."""
    graph = builder.graph
    inputs = [v for v in graph.values.values() if v.kind == "input" and v.meta is not None and v.meta.ndim >= 1]
    batch = inputs[0].meta.shape[0] if inputs else None
    dim: dict[str, Optional[int]] = {v.name: (0 if v.meta.shape[0] == batch else None) for v in inputs}
    data = {v.name for v in graph.values.values() if v.kind == "input"}
    reductions: dict[str, tuple[OpHandle, int]] = {}
    norms: dict[str, OpHandle] = {}
    for op in builder.ops:
        sig = op.signature
        if any(name in data for name in op.node.inputs):
            data.update(o for o in op.node.outputs if o is not None)
        if batch_norm_in_training(op):
            d = dim.get(op.node.inputs[0]) if op.node.inputs else None
            if d is not None and d != 1:  # dim 1 is the channel: any other dim is reduced over
                norms[op.name] = op
            if op.node.outputs and op.node.outputs[0] is not None:
                dim[op.node.outputs[0]] = d  # the output is the input normalized: its batch dim stays
            continue
        label, whole, carrier = None, None, 0
        for i, name in enumerate(op.node.inputs):
            d, labs = dim.get(name), (sig.inputs[i] if i < len(sig.inputs) else None)
            if d is not None and (labs is None or d >= len(labs) or sig.is_frozen(labs[d])):
                whole = i if whole is None else whole  # the op reads the batch whole
            elif d is not None:
                label, carrier = labs[d], i
                break
        outs = [sig.outputs[j] if j < len(sig.outputs) else None for j in range(len(op.node.outputs))]
        rows = carrier if label is not None else whole
        if op.node.op_name.startswith(_SCATTER_SUMS) and rows not in (None, 0):
            reductions[op.name] = (op, rows)  # the batch's rows added into a buffer
            label = None
        elif label is not None and label in sig.reduce and not any(o and label in o for o in outs):
            reductions[op.name] = (op, carrier)
        elif label is None and whole is not None and op.node.op_name.startswith(_COUNTS):
            reductions[op.name] = (op, whole)  # reads the whole batch to count over it
        for out, labs in zip(op.node.outputs, outs):
            if out is not None:
                dim[out] = labs.index(label) if label is not None and labs and label in labs else None
        if op.node.op_name.startswith(_ROWS_KEPT) and op.node.inputs and dim.get(op.node.inputs[0]) == 0:
            _rows_kept(graph, op, dim)
    return reductions, data, norms


def _rows_kept(graph, op: OpHandle, dim: dict[str, Optional[int]]) -> None:
    """A reshape or repeat whose input has the batch outermost keeps it outermost when its rows
    only grow by a whole factor (tokens x top-k flattened, each row repeated k times)."""
    rows = graph.meta(op.node.inputs[0]).shape[0]
    out = op.node.outputs[0]
    meta = graph.meta(out) if out is not None else None
    if meta is not None and meta.ndim >= 1 and rows and meta.shape[0] % rows == 0:
        dim[out] = 0


def _loss_ancestors(builder: PlanBuilder, data: set[str]) -> tuple[set[str], set[str]]:
    """(ops the loss depends on, ops it depends on linearly), by op name."""
    graph = builder.graph
    at = loss_position(len(graph.outputs), graph.out_spec,
                       [o is not None and graph.meta(o).ndim == 0 for o in graph.outputs])
    loss = graph.outputs[at] if at is not None else None
    if loss is None:
        return set(), set()
    producer = {o: op for op in builder.ops for o in op.node.outputs if o is not None}
    ancestors: set[str] = set()
    stack = [loss]
    while stack:
        op = producer.get(stack.pop())
        if op is not None and op.name not in ancestors:
            ancestors.add(op.name)
            counts = op.signature.row_counts  # counts of the op's own rows: each replica's, not statistics
            stack.extend(v for i, v in enumerate(op.node.inputs) if i not in counts)
    linear: set[str] = set()
    stack = [loss]
    while stack:
        op = producer.get(stack.pop())
        if op is None or op.name in linear:
            continue
        linear.add(op.name)
        name = op.node.op_name
        if name.startswith(_THROUGH_ALL):
            stack.extend(op.node.inputs)
        elif name.startswith(_SCALINGS):
            ins = list(op.node.inputs)
            dependent = [v for v in ins if v in data]
            if name.startswith("aten.mul.") and len(dependent) == 1:
                stack.extend(dependent)
            elif name.startswith("aten.div.") and ins and all(v not in data for v in ins[1:]):
                stack.append(ins[0])
    return ancestors, linear


def batch_statistics(builder: PlanBuilder, strategy: str,
                     way_out: str = "pass batch_statistics='local'") -> dict[str, list]:
    """{op name: ["sum" | "mean" | "batch_norm", index of the input carrying the batch]} for each
    batch norm in training over the batch and each reduction over the batch the loss uses
    nonlinearly; refuses (by name) one whose pieces the replicas cannot combine exactly."""
    reductions, data, norms = _batch_reductions(builder)
    ancestors, linear = _loss_ancestors(builder, data)
    producer = {o: op for op in builder.ops for o in op.node.outputs if o is not None}
    found: dict[str, list] = {}
    for name, op in norms.items():  # whatever reads it: its output and its running statistics are the batch's
        if op.node.op_name not in BATCH_NORM_KERNELS:
            raise PlanError(f"strategy {strategy!r}: batch norm in training ({op.node.op_name}) cannot be given the "
                            f"whole batch's statistics across data-parallel replicas; {way_out} to normalize each "
                            "replica with its own rows (DDP without SyncBatchNorm)", op=name, where=op.where())
        found[name] = ["batch_norm", 0]
    for name, (op, carrier) in reductions.items():
        if name not in ancestors or name in linear:
            continue
        target = op.node.op_name
        meta = builder.graph.meta(op.node.outputs[0]) if op.node.outputs and op.node.outputs[0] else None
        exact = meta is not None and meta.dtype.is_floating_point and len(op.node.outputs) == 1
        reduces = op.signature.reduce and any(l in op.signature.reduce for l in op.signature.labels())
        buffer = producer.get(op.node.inputs[0]) if op.node.inputs else None
        if exact and target.startswith(_MEANS):
            found[name] = ["mean", carrier]
        elif exact and (target.startswith(_SUMS + _COUNTS) or (reduces and op.signature.localize is None)):
            found[name] = ["sum", carrier]  # the pieces of a reduction without a piece function are partial sums
        elif exact and target.startswith(_SCATTER_SUMS) and buffer is not None \
                and buffer.node.op_name.startswith(_ZEROS):
            found[name] = ["sum", carrier]
        else:
            raise PlanError(f"strategy {strategy!r}: the loss uses this reduction over the batch ({target}) "
                            "nonlinearly, and its data-parallel pieces cannot be combined into the whole batch's "
                            f"value; {way_out} to compute it per replica (as DDP does)",
                            op=name, where=op.where())
    return found


def refuse_micro_batches(builder: PlanBuilder, strategy: str, found: dict[str, list], micro: int,
                         way_out: str = "pass batch_statistics='local'") -> None:
    """Micro-batches see one micro-batch each, which no order of the forwards makes whole before
    the first backward in 1F1B: refused, naming the first such reduction and the way out."""
    names = ", ".join(sorted(found))
    first = next(op for op in builder.ops if op.name in found)
    kinds = sorted({"batch norm's mean and variance" if found[n][0] == "batch_norm" else
                    "a statistic the loss uses nonlinearly (a router load-balancing loss)" for n in found})
    raise PlanError(f"strategy {strategy!r}: with {micro} micro-batches, the statistics over the batch "
                    f"({names}: {' and '.join(kinds)}) would be computed per micro-batch, not over "
                    f"the whole batch as one device does; {way_out} to accept that "
                    "(per-micro-batch statistics, as gradient accumulation in PyTorch and Megatron's "
                    "auxiliary loss have them), or train without micro-batches",
                    op=first.name, where=first.where())


def apply_batch_statistics(builder: PlanBuilder, mode: Optional[str] = None) -> None:
    """Record the plan's batch statistics (the pass every built-in strategy ends with): "global"
    (the default) finds the batch norms in training and the reductions the loss uses nonlinearly
    and records them for the lowering to make whole across data-parallel replicas; "local" keeps
    each replica's own (Hugging Face under DDP, DDP without SyncBatchNorm). Micro-batches see one
    micro-batch each, which no order of the forwards makes whole before the first backward in
    1F1B: "global" with micro-batches is refused when there are any. A plan without either (a
    dense LM, a model in eval mode) records nothing and plans exactly as before."""
    strategy = builder.strategy
    mode = mode or "global"
    if mode not in ("global", "local"):
        raise PlanError(f"strategy {strategy!r}: batch_statistics={mode!r}; use 'global' or 'local'")
    if mode == "local":
        builder.set_knobs(batch_statistics="local", batch_statistic_ops={})
        return
    found = batch_statistics(builder, strategy)
    if not found:
        return
    micro = builder.pipeline.micro_batches if builder.pipeline is not None else builder.micro_batches
    if micro > 1:
        refuse_micro_batches(builder, strategy, found, micro)
    builder.set_knobs(batch_statistics="global", batch_statistic_ops={k: tuple(v) for k, v in found.items()})


def with_batch_statistics(plan: Plan, graph: Graph, builder: Optional[PlanBuilder] = None) -> Plan:
    """`plan` with its batch statistics found, when it has data-parallel replicas or micro-batches
    and does not already say ("local", or the strategy's findings); refused by name when they
    cannot be made whole (micro-batches). A plan whose loss has no such reduction is returned as is.
    `builder`, the one that made the plan, saves computing the ops' signatures again."""
    knobs = plan.knobs
    micro = plan.num_micro_batches
    if knobs.batch_statistics == "local" or knobs.batch_statistic_ops or (plan.dp == 1 and micro == 1):
        return plan
    if builder is None:
        builder = PlanBuilder(graph, mesh=plan.mesh, strategy=plan.strategy, micro_batches=micro)
        way_out = "set the plan's knobs to batch_statistics='local' (plan.knobs.replace(batch_statistics='local'))"
    else:
        way_out = "pass batch_statistics='local' (a strategy that does not take it: builder.set_knobs(" \
                  "batch_statistics='local'))"
    found = batch_statistics(builder, plan.strategy, way_out)
    if not found:
        return plan
    if micro > 1:
        refuse_micro_batches(builder, plan.strategy, found, micro, way_out)
    return dataclasses.replace(plan, knobs=knobs.replace(batch_statistic_ops={k: tuple(v) for k, v in found.items()}))
