"""Losses. Cross-entropy may split its class dim (vocabulary-parallel: the pieces exchange the
max, the sum of exponentials and the target logit) or its batch dim (partial sums of the mean,
divided by the global count of counted targets)."""
from __future__ import annotations

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.kernels import piece_functions


@rule("aten.cross_entropy_loss.default")
def cross_entropy(call: OpCall) -> Signature:
    logits, target = call.inputs[0], call.inputs[1]
    weight_given = len(call.inputs) > 2
    reduction = call.arg(3, "reduction", 1)
    ignore_index = call.arg(4, "ignore_index", -100)
    smoothing = call.arg(5, "label_smoothing", 0.0)
    if target.dtype.is_floating_point:  # class probabilities: keep it simple and whole
        return None
    extra = tuple(f"x{i}" for i in range(2, logits.ndim))
    class_label = "^c" if (weight_given or smoothing) else "c"
    ins = [("n", class_label) + extra, ("n",) + extra]
    if weight_given:
        ins.append((class_label,))
    if reduction == 0:
        out = ("n",) + extra
        reduce = frozenset()
    else:
        out = ()
        reduce = frozenset({"n"} | set(extra))

    def localize(lc: LocalCall) -> Localized:
        c_split = "c" in lc.splits
        n_split = any(l in lc.splits for l in ("n",) + extra)
        if c_split and n_split and reduction != 0:
            raise PlanError("cross-entropy split on both its class and batch dims is not supported; "
                            "split one of them")
        if c_split:
            start = lc.index["c"] * lc.local_inputs[0].shape[1]
            if n_split:  # reduction none: rows are independent, the class split works per row
                pass
            return Localized(piece_functions.vocab_parallel_cross_entropy,
                             (call.args[0], call.args[1], start, reduction, ignore_index), group_label="c")
        if n_split and reduction == 1:
            label = next(l for l in ("n",) + extra if l in lc.splits)
            args = list(call.args) + [None] * (6 - len(call.args))
            return Localized(piece_functions.batch_split_mean_cross_entropy,
                             (args[0], args[1], args[2], 1, ignore_index, smoothing or 0.0), group_label=label)
        return Localized(call.target, call.args, call.kwargs)

    # the rows (a sum, or a mean over the global count of counted targets) need no offsets, so
    # they may be split in blocks: the mirrored sequence pieces of flattened logits
    return Signature(inputs=tuple(ins), outputs=(out,), reduce=reduce, localize=localize,
                     comm_labels=frozenset({"c"} | ({"n"} | set(extra) if reduction == 1 else set())),
                     order_free=frozenset({"n"} | set(extra)))


@rule("aten.mse_loss.default", "aten.l1_loss.default", "aten.smooth_l1_loss.default", "aten.huber_loss.default")
def pointwise_loss(call: OpCall) -> Signature:
    """Mean/sum of a pointwise loss: with reduction none every dim is spatial; with sum, every dim
    is a reduction. A mean is left whole (its divisor would need every piece's count)."""
    x = call.inputs[0]
    reduction = call.arg(2, "reduction", 1)
    labs = tuple(f"d{i}" for i in range(x.ndim))
    if reduction == 0:
        return Signature(inputs=(labs, labs), outputs=(labs,))
    if reduction == 2:
        return Signature(inputs=(labs, labs), outputs=((),), reduce=frozenset(labs))
    frozen = tuple(f"^d{i}" for i in range(x.ndim))
    return Signature(inputs=(frozen, frozen), outputs=((),))
