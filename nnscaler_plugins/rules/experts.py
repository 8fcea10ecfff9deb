"""Grouped expert matmuls (mixture-of-experts layers): `out[rows of e] = input[rows of e] @ weight[e]`.

Transformers 5.x runs its MoE experts through one grouped matmul per projection:
`grouped_mm(input (S, k), weight (E, k, n), offs (E,))`, the rows sorted by expert and `offs` the
cumulative row count of each expert. Three dims may be split:

- `n`, the expert FFN's output features (spatial): every piece computes its columns for every
  expert, the weight split along its last dim (column parallelism inside each expert; a fused
  gate/up projection is split in blocks by the `chunk` that follows, as for dense layers).
- `k`, the input features (a reduction shared by the input and the weight): each piece gives a
  partial sum (row parallelism inside each expert, the down projection).
- `e`, the experts (a reduction only the weight carries): a piece holds a contiguous range of
  experts and computes the rows routed to them, zeros elsewhere; the pieces' outputs add up to
  the whole (`runtime.grouped_experts`). This is expert parallelism read as a partial sum; a
  dispatching implementation (all-to-all of the rows) can replace the piece function and keep
  this rule's labels.

The rows stay whole: which rows belong to which expert is data (`offs`), so a row range is not
a fixed chunk of any one expert. `offs` is always whole.
"""
from __future__ import annotations

from nnscaler_plugins.rules.registry import op_key, rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.kernels import grouped_experts

GROUPED_MM = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")


@rule(*GROUPED_MM)
def grouped_mm(call: OpCall) -> Signature:
    if len(call.inputs) != 3:  # a bias, or no offsets: kept whole
        return None
    x, w, offs = call.inputs
    if x.ndim != 2 or w.ndim != 3 or offs.ndim != 1 or offs.shape[0] != w.shape[0]:
        return None
    key = op_key(call.target)

    def localize(lc: LocalCall) -> Localized:
        if "e" not in lc.splits:
            return Localized(call.target, call.args, call.kwargs)
        local = lc.local_inputs[1].shape[0]
        refs = [a for a in call.args] + [call.kwargs[k] for k in ("offs",) if k in call.kwargs]
        return Localized(grouped_experts.expert_slice_grouped_mm,
                         (refs[0], refs[1], refs[2], lc.index["e"] * local, key))

    return Signature(inputs=(("^s", "k"), ("e", "k", "n"), None), outputs=(("^s", "n"),),
                     reduce=frozenset({"k", "e"}), localize=localize)
