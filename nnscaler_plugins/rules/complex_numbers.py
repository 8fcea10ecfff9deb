"""Complex numbers: what rotary embeddings written the way Llama's reference code writes them use.

`view_as_complex` reads the last dim (of length 2) of a real tensor as (real, imaginary) and drops
it; `view_as_real` gives it back; `polar`, `complex`, a complex multiply and the parts (`real`,
`imag`, `angle`, the conjugates) are elementwise. So every other dim keeps its label through the
round trip, and the heads (tensor parallelism) and the sequence (context parallelism) of q and k
stay split through the rotation; only the pair dim is frozen. A complex multiply is the elementwise
`aten.mul.Tensor` (rules/elementwise.py).
"""
from __future__ import annotations

from nnscaler_plugins.rules.broadcast import broadcast_labels, out_labels
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature


@rule("aten.view_as_complex.default")
def view_as_complex(call: OpCall) -> Signature:
    """(..., 2) real -> (...) complex: the leading dims shared, the pair dim frozen."""
    out = call.outputs[0]
    labels = out_labels(out.ndim)
    return Signature(inputs=(labels + ("^pair",),), outputs=(labels,))


@rule("aten.view_as_real.default")
def view_as_real(call: OpCall) -> Signature:
    """(...) complex -> (..., 2) real."""
    labels = out_labels(call.inputs[0].ndim)
    return Signature(inputs=(labels,), outputs=(labels + ("^pair",),))


@rule("aten.polar.default", "aten.complex.default", "aten.real.default", "aten.imag.default", "aten.angle.default",
      "aten.conj.default", "aten._conj.default", "aten.conj_physical.default", "aten.resolve_conj.default",
      "aten.resolve_neg.default")
def complex_elementwise(call: OpCall) -> Signature:
    """Each output element from the same element of each (broadcast) input."""
    out = call.outputs[0]
    if out is None:
        return None
    ins = tuple(broadcast_labels(m, out.shape, str(i)) for i, m in enumerate(call.inputs))
    return Signature(inputs=ins, outputs=(out_labels(out.ndim),))
