"""What the ops whose pieces run a kernel that talks to its own device group cost.

Two rules hand a split piece a kernel with a group instead of leaving the communication to the
lowering: a mixture-of-experts layer captured as one op (`rules/experts_op.py`, label `t`: tokens
and experts split together, rows moved by all-to-all inside the kernel) and self-attention split
along its sequence (`rules/attention.py`, label `s`: context parallelism, keys and values met by
the plan's `cp_comm`). The lowering inserts no collective for either, so the ordinary formula
(`CostModel.op_time`: 1/n of the work, no communication) would price them as free splits. Here:

- experts: the FLOPs of the experts themselves (each token through its top-k experts: 2 FLOPs per
  expert weight per routed row; the op's ordinary cost sees no matmul in it), 1/ep of them per
  device under even routing; split, the dispatch and combine all-to-alls in forward and the same
  two in backward, priced on the link hierarchy (`Network.all_to_all`: inside a node or across);
  kept for backward: the rows received and the experts' intermediates (the unsplit op recomputes
  its forward in backward instead, one more expert pass). Split along each expert's width too
  (label `f`, expert tensor parallelism), a device computes 1/etp of every routed row's work on
  1/etp of the weights; the exchanges are unchanged (each slice's group moves the same rows) and
  the partial outputs are summed by the lowering, priced as any reduce label's.
- attention split along the sequence: `context_parallel_cost` for the plan's `cp_comm` (ring
  blocks overlapped with the block's attention, the all-gather, Ulysses' four all-to-alls), with
  the whole-sequence attention time of the piece's other splits (batch, heads) from the op's own
  kernel pricing; causal balancing is the mirrored 2-block split (block count -2).

`price` returns None for every other op, which keeps its ordinary cost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from nnscaler_plugins.capture.autograd_functions import FunctionTarget
from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.kernels.experts_module import ExpertsCall
from nnscaler_plugins.search.context_parallel_cost import (
    AttentionShape,
    context_parallel_attention_time,
)
from nnscaler_plugins.search.costmodel import CostModel, OpTime, Training
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.network import span_of

ATTENTION = "aten.scaled_dot_product_attention.default"
SEQUENCE = "s"  # rules/attention.py
EXPERTS = "t"  # rules/experts_op.py
WIDTH = "f"  # rules/experts_op.py: each expert's intermediate width
CP_MODES = ("ring", "allgather", "ulysses")


@dataclass(frozen=True)
class GroupKernelCost:
    time: OpTime  # compute, with communication the kernel overlaps inside it (ring attention)
    fwd_comm: float  # exposed communication, forward
    bwd_comm: float  # and backward
    kept: float  # bytes per device the kernel keeps for backward beyond the op's saved inputs


def kind_of(graph: Optional[Graph], op: OpNode) -> Optional[str]:
    """"experts", "attention" or None."""
    t = op.target
    if isinstance(t, FunctionTarget) and t.cls is ExpertsCall:
        return "experts"
    if op.op_name == ATTENTION or str(t) == ATTENTION:
        return "attention"
    return None


def is_cp_split(graph: Graph, op: OpNode, counts: dict) -> bool:
    """Whether a placement with these label counts is context parallelism of an attention op."""
    return counts.get(SEQUENCE, 1) > 1 and kind_of(graph, op) == "attention"


def _group(p: Placement, label: str, to_global: Callable[[int], int]) -> list[int]:
    """The global devices of the pieces that differ only in `label` (replica 0, other digits 0)."""
    n = dict(p.splits).get(label, 1)
    stride = 1
    for l, k in reversed(p.splits):
        if l == label:
            break
        stride *= k
    return [to_global(p.devices[i * stride]) for i in range(n)]


def price(cm: CostModel, op: OpNode, p: Placement, training: Training, cp_comm: str = "ring",
          to_global: Callable[[int], int] = lambda d: d) -> Optional[GroupKernelCost]:
    kind = kind_of(cm.graph, op)
    if kind == "experts":
        return _experts(cm, op, p, training, to_global)
    if kind == "attention" and dict(p.splits).get(SEQUENCE, 1) > 1:
        return _attention(cm, op, p, training, cp_comm, to_global)
    return None


def _experts(cm: CostModel, op: OpNode, p: Placement, training: Training, to_global) -> Optional[GroupKernelCost]:
    g = cm.graph
    metas = [g.values[v].meta for v in op.inputs]
    if len(metas) < 4 or any(m is None for m in metas[:4]):
        return None
    x, ids = metas[0], metas[1]
    params = [m for m in metas[3:] if m is not None and m.ndim >= 2]
    tokens, hidden = int(x.shape[0]), int(x.shape[1])
    top_k = int(ids.shape[1])
    experts = int(params[0].shape[0])
    per_expert = sum(m.numel for m in params) / experts
    counts = p.label_counts()
    ep = counts.get(EXPERTS, 1)
    etp = counts.get(WIDTH, 1)
    rows = tokens * top_k / ep  # routed rows one device computes (even routing)
    flops = 2.0 * rows * per_expert / etp
    rate = cm.matmul_rate(training.dtype)
    kernels = cm.cluster.kernels
    if kernels is not None:  # grouped GEMMs: rows per expert x expert width x hidden
        width = per_expert / max(hidden, 1) / etp
        eff = kernels.matmul_efficiency(max(1.0, rows * ep / experts), width, hidden, max(1, experts // ep),
                                        training.dtype)
        rate = cm.cluster.flops(training.dtype) * cm.cluster.efficiency.sustained * max(eff, 1e-3)
    isz = training.act_bytes
    weights = per_expert * experts / (ep * etp) * training.param_bytes
    mem_rate = cm.cluster.memory_bandwidth * cm.cluster.efficiency.memory
    oh = cm.cluster.efficiency.op_overhead_s
    fwd = max(flops / rate, weights / mem_rate) + oh
    if ep <= 1:
        # ExpertsCall: forward without a graph, backward runs the experts again with autograd
        t = OpTime(fwd, fwd + flops / rate + oh, flops / rate, flops)
        return GroupKernelCost(t, 0.0, 0.0, 0.0)
    t = OpTime(fwd, flops / rate + oh, flops / rate, flops)
    span = span_of(cm.cluster, _group(p, EXPERTS, to_global))
    moved = rows * hidden * isz * ep  # the whole exchange over the group: every device's routed rows
    exchange = cm.net.all_to_all(moved, span) + cm.net.all_gather(4.0 * experts * ep, span)  # rows, then counts
    fwd_comm = exchange + cm.net.all_to_all(moved, span)  # dispatch (with the counts) and combine
    bwd_comm = 2 * cm.net.all_to_all(moved, span)
    kept = rows * (hidden + per_expert / max(hidden, 1) / etp) * isz  # rows received, the experts' intermediates
    return GroupKernelCost(t, fwd_comm, bwd_comm, kept)


def _attention(cm: CostModel, op: OpNode, p: Placement, training: Training, mode: str,
               to_global) -> Optional[GroupKernelCost]:
    g = cm.graph
    q, k = g.meta(op.inputs[0]), g.meta(op.inputs[1])
    counts = p.label_counts()
    cp = counts.get(SEQUENCE, 1)
    sig = cm.costs.signatures[op.name]
    labs = sig.inputs[0]
    lead = q.ndim - 2  # (batch..., heads, seq, feature) or (batch, seq, feature)
    hsplit = counts.get(labs[lead - 1], 1) if lead >= 2 else 1
    heads = int(q.shape[-3]) if lead >= 2 else 1
    kv_heads = int(k.shape[-3]) if lead >= 2 else 1
    batch = math.prod(int(q.shape[i]) // counts.get(labs[i], 1) for i in range(lead - 1 if lead >= 2 else lead))
    attn = cm.costs.ops[op.name].attn
    shape = AttentionShape(batch=max(1, batch), heads=max(1, heads // hsplit), kv_heads=max(1, kv_heads // hsplit),
                           length=int(q.shape[-2]), head_dim=int(q.shape[-1]), causal=bool(attn[4]) if attn else False,
                           itemsize=training.act_bytes)
    local = cm.op_time(op.name, p, training)  # 1/cp of the sequence's queries against their keys
    whole = local.fwd * cp
    ratio = local.bwd / local.fwd if local.fwd > 0 else 2.5
    balanced = dict(p.blocks).get(SEQUENCE, 1) == -2
    span = span_of(cm.cluster, _group(p, SEQUENCE, to_global))
    if mode == "ulysses" and not ulysses_fits(cm, op, counts):
        return None  # the search keeps such plans out (`ulysses_fits`)
    c = context_parallel_attention_time(cm.net, span, shape, cp, mode, whole, ratio, balanced)
    return GroupKernelCost(OpTime(c.forward, c.backward, 0.0, local.flops), 0.0, 0.0, 0.0)


def ulysses_fits(cm: CostModel, op: OpNode, counts: dict) -> bool:
    """Ulysses swaps the sequence split for a head split: the piece's query and key/value heads
    (after any head split of tensor parallelism) must divide by cp."""
    q, k = cm.graph.meta(op.inputs[0]), cm.graph.meta(op.inputs[1])
    if q.ndim < 4:
        return False
    labs = cm.costs.signatures[op.name].inputs[0]
    cp, hsplit = counts.get(SEQUENCE, 1), counts.get(labs[q.ndim - 3], 1)
    return (q.shape[-3] // hsplit) % cp == 0 and (k.shape[-3] // hsplit) % cp == 0 and k.shape[-3] % hsplit == 0
