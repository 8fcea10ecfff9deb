"""Matmuls with a weight parameter and embedding lookups: where column, row and vocabulary
parallelism are decided.

Both are readings of an op's dimension rule. A matmul with a weight has a reduce label `k` shared
by exactly one activation input and one parameter, and an output-feature label `n` carried by the
parameter and the output but not by the activation: column parallelism splits `n` (the output
comes out split), row parallelism splits `k` (the output comes out as partial sums). An embedding
lookup has a reduce label that only a parameter carries (the vocabulary): splitting it gives a
partial-sum output. The tensor-parallel strategy and the search both start from these ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.rules import Signature

_STATIC = ("param", "buffer", "constant")

# Ops that hand a parameter on as the same numbers in another layout or dtype: a matmul reading
# `weight.T` (Falcon's linear, transformers' expert weights) or `weight.to(dtype)` still multiplies
# by a parameter, so its weight dims are where tensor parallelism splits.
_WEIGHT_VIEWS = frozenset({
    "aten.t.default", "aten.numpy_T.default", "aten.transpose.int", "aten.permute.default",
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.contiguous.default",
    "aten.alias.default", "aten.detach.default", "aten.clone.default", "aten.to.dtype",
    "aten.to.dtype_layout", "aten._to_copy.default",
    "aten.slice.Tensor",  # one section's rows of a fused projection (capture/fused_sections.py)
})


def weight_source(graph: Graph, value: str) -> Optional[str]:
    """The parameter a value is a view (or a cast) of, through ops that only move its numbers;
    None when the value is computed from anything else."""
    seen = 0
    while seen < 8:
        v = graph.values[value]
        if v.kind == "param":
            return value
        if v.kind != "op" or v.producer is None:
            return None
        op = graph.op(v.producer)
        if str(op.target) not in _WEIGHT_VIEWS or len(op.inputs) != 1:
            return None
        value = op.inputs[0]
        seen += 1
    return None


@dataclass(frozen=True)
class MatmulAnchor:
    activation: int  # input index of the activation
    weight: int  # input index of the parameter
    k: str  # the reduce label shared by both
    n: Optional[str]  # the output-feature label, carried by the weight and the output only


@dataclass(frozen=True)
class VocabAnchor:
    weight: int  # input index of the table
    label: str  # the vocabulary: the reduce label only the table carries


def matmul_anchor(graph: Graph, op: OpNode, sig: Signature) -> Optional[MatmulAnchor]:
    """The matmul reading of an op's rule: a reduce label shared by one activation and one parameter."""
    names = op.inputs
    for k in sorted(sig.reduce):
        if sig.is_frozen(k):
            continue
        carriers = sorted({i for i, _ in sig.dims_of(k)[0]})
        weights = [i for i in carriers if weight_source(graph, names[i]) is not None]
        acts = [i for i in carriers if graph.values[names[i]].kind not in _STATIC and i not in weights]
        if len(weights) != 1 or len(acts) != 1:
            continue
        w, a = weights[0], acts[0]
        act_labels = set(sig.inputs[a] or ())
        out_labels = {l for lab in sig.outputs for l in (lab or ())}
        n = next((l for l in sig.inputs[w] or () if l != k and sig.kind(l) == "spatial"
                  and l not in act_labels and l in out_labels), None)
        return MatmulAnchor(a, w, k, n)
    return None


def vocab_anchor(graph: Graph, op: OpNode, sig: Signature) -> Optional[VocabAnchor]:
    """The embedding reading of an op's rule: a reduce label carried by a parameter and nothing else."""
    for k in sorted(sig.reduce):
        if sig.is_frozen(k):
            continue
        carriers = sorted({i for i, _ in sig.dims_of(k)[0]})
        if len(carriers) == 1 and graph.values[op.inputs[carriers[0]]].kind == "param":
            return VocabAnchor(carriers[0], k)
    return None
