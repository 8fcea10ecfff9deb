"""Matmuls with a weight parameter: where column and row parallelism are decided.

The reading of an op's dimension rule that makes it a matmul with a weight: a reduce label `k`
shared by exactly one activation input and one parameter, and an output-feature label `n` carried by
the parameter and the output but not by the activation. Column parallelism splits `n` (the output
comes out split), row parallelism splits `k` (the output comes out as partial sums).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..graph import Graph, OpNode
from ..rules import Signature

_STATIC = ("param", "buffer", "constant")


@dataclass(frozen=True)
class Anchor:
    activation: int
    weight: int
    k: str
    n: Optional[str]


def matmul_anchor(graph: Graph, op: OpNode, sig: Signature) -> Optional[Anchor]:
    names = op.inputs
    for k in sorted(sig.reduce):
        if sig.is_frozen(k):
            continue
        carriers = sorted({i for i, _ in sig.dims_of(k)[0]})
        weights = [i for i in carriers if graph.values[names[i]].kind == "param"]
        acts = [i for i in carriers if graph.values[names[i]].kind not in _STATIC]
        if len(weights) != 1 or len(acts) != 1:
            continue
        w, a = weights[0], acts[0]
        act_labels = set(sig.inputs[a] or ())
        out_labels = {l for lab in sig.outputs for l in (lab or ())}
        n = next((l for l in sig.inputs[w] or () if l != k and sig.kind(l) == "spatial"
                  and l not in act_labels and l in out_labels), None)
        return Anchor(a, w, k, n)
    return None


def vocab_label(graph: Graph, op: OpNode, sig: Signature) -> Optional[str]:
    """An embedding-style lookup: the reduce label only a parameter carries (the vocabulary)."""
    for k in sorted(sig.reduce):
        if sig.is_frozen(k):
            continue
        carriers = sorted({i for i, _ in sig.dims_of(k)[0]})
        if len(carriers) == 1 and graph.values[op.inputs[carriers[0]]].kind == "param":
            return k
    return None
