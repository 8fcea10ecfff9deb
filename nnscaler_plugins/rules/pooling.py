"""Pooling: each output element reads a window of one channel of one sample, so batch and channel
dims may be split; the pooled (spatial) dims stay whole (a split would need the windows that
cross a chunk border)."""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature

POOLING = [
    "aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
    "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default",
    "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
    "aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool3d.default",
    "aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool3d.default",
]


@rule(*POOLING)
def pooling(call: OpCall) -> Signature:
    x = call.inputs[0]
    pooled = {"1d": 1, "2d": 2, "3d": 3}
    k = next((v for s, v in pooled.items() if s in str(call.target)), 2)
    if x.ndim < k + 1:
        return None
    lead = tuple(f"d{i}" for i in range(x.ndim - k))  # (batch,) channel, or channel alone unbatched
    ins = lead + tuple(f"^p{i}" for i in range(k))
    outs = tuple(lead + tuple(f"^q{j}_{i}" for i in range(k)) if o is not None else None
                 for j, o in enumerate(call.outputs))
    return Signature(inputs=(ins,), outputs=outs)
