"""Elementwise ops (with broadcasting) and value-preserving copies: every output dim is spatial."""
from __future__ import annotations

from nnscaler_plugins.rules.broadcast import broadcast_labels, out_labels, provider_labels
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature

UNARY_OR_BROADCAST = [
    # arithmetic
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.div.Tensor_mode",
    "aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.rsub.Scalar",
    "aten.rsub.Tensor", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.neg.default",
    "aten.rsqrt.default", "aten.sqrt.default", "aten.exp.default", "aten.log.default", "aten.abs.default",
    "aten.reciprocal.default", "aten.square.default", "aten.clamp.default", "aten.clamp_min.default",
    "aten.maximum.default", "aten.minimum.default", "aten.lerp.Scalar",
    # activations
    "aten.tanh.default", "aten.gelu.default", "aten.silu.default", "aten.relu.default", "aten.sigmoid.default",
    "aten.softplus.default", "aten.erf.default", "aten.sin.default", "aten.cos.default", "aten.hardtanh.default",
    "aten.leaky_relu.default", "aten.elu.default", "aten.mish.default",
    # comparisons and logic
    "aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar", "aten.ge.Tensor", "aten.ge.Scalar",
    "aten.gt.Tensor", "aten.gt.Scalar", "aten.le.Tensor", "aten.le.Scalar", "aten.lt.Tensor", "aten.lt.Scalar",
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.bitwise_not.default", "aten.logical_not.default", "aten.logical_and.default", "aten.logical_or.default",
    "aten.where.self", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.isnan.default",
    # copies, casts, dropout
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default",
    "aten.lift_fresh_copy.default", "aten.dropout.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.full_like.default", "aten.empty_like.default", "aten.fill.Scalar", "aten.fill.Tensor",
    "aten.copy.default",
    # scalar forms, integer division, min/max against another tensor
    "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar", "aten.floor_divide.default",
    "aten.floor_divide.Scalar", "aten.remainder.Scalar", "aten.remainder.Tensor", "aten.min.other",
    "aten.max.other", "aten.fmod.Scalar", "aten.fmod.Tensor", "aten.floor.default", "aten.ceil.default",
    "aten.round.default", "aten.sign.default", "aten.gelu_backward.default", "aten.logical_xor.default",
    "aten.bitwise_xor.Tensor", "aten.clamp.Tensor", "aten.clamp_max.default", "aten.log1p.default",
    "aten.expm1.default", "aten.atan.default", "aten.pow.Scalar",
]


@rule(*UNARY_OR_BROADCAST)
def elementwise(call: OpCall) -> Signature:
    """Each output element depends only on the same element of each (broadcast) input, so every
    output dim may be split; an input's broadcast dims stay whole. Dropout pieces draw their own
    masks: equal in distribution, not bit for bit, to the unsplit op."""
    out = call.outputs[0]
    if out is None:
        return None
    ins = tuple(broadcast_labels(m, out.shape, str(i)) for i, m in enumerate(call.inputs))
    return Signature(inputs=ins, outputs=(out_labels(out.ndim),))


@rule("aten.type_as.default")
def type_as(call: OpCall) -> Signature:
    """`x.type_as(other)`: `other` only gives the dtype (see `provider_labels`)."""
    out = call.outputs[0]
    if out is None:
        return None
    ins = (broadcast_labels(call.inputs[0], out.shape, "0"),)
    ins += tuple(provider_labels(m, f"dtype{i}_") for i, m in enumerate(call.inputs[1:]))
    return Signature(inputs=ins, outputs=(out_labels(out.ndim),))


@rule("aten.broadcast_tensors.default")
def broadcast_tensors(call: OpCall) -> Signature:
    out = call.outputs[0]
    ins = tuple(broadcast_labels(m, out.shape, str(i)) for i, m in enumerate(call.inputs))
    return Signature(inputs=ins, outputs=tuple(out_labels(out.ndim) for _ in call.outputs))
