"""Tensor factories: no tensor inputs to follow, so they are made whole on each device that needs
them (they are cheap: ranges, masks, constants)."""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature


@rule("aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.full.default",
      "aten.zeros.default", "aten.ones.default", "aten.empty.memory_format", "aten.scalar_tensor.default",
      "aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default",
      "aten.tensor.default", "aten.rand.default", "aten.randn.default", "aten.tril.default", "aten.triu.default")
def factory(call: OpCall) -> Signature:
    return Signature(inputs=tuple(None for _ in call.inputs), outputs=tuple(None for _ in call.outputs),
                     note="factory: made whole where needed")
