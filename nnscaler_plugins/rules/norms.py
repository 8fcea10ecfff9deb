"""Normalizations: the normalized dims must stay whole; the leading dims are spatial."""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature


@rule("aten.layer_norm.default", "aten.rms_norm.default")
def layer_norm(call: OpCall) -> Signature:
    x = call.inputs[0]
    shape = call.arg(1, "normalized_shape")
    k = len(shape)
    lead = tuple(f"d{i}" for i in range(x.ndim - k))
    normed = tuple(f"^n{j}" for j in range(k))
    ins = [lead + normed] + [normed for _ in call.inputs[1:]]
    return Signature(inputs=tuple(ins), outputs=(lead + normed,))


@rule("aten.group_norm.default")
def group_norm(call: OpCall) -> Signature:
    x = call.inputs[0]
    rest = tuple(f"^x{i}" for i in range(x.ndim - 1))
    ins = [("b",) + rest] + [(rest[0],) for _ in call.inputs[1:]]
    return Signature(inputs=tuple(ins), outputs=(("b",) + rest,))
