"""Reductions: summed dims are reductions (pieces give partial sums); max-like dims stay whole."""
from __future__ import annotations

from nnscaler_plugins.rules.broadcast import norm_dim
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.kernels import piece_functions


def _reduced(call: OpCall, dims_arg_index: int = 1) -> tuple[list[int], bool]:
    x = call.inputs[0]
    dims = call.arg(dims_arg_index, "dim", None)
    if dims is None or dims == []:
        dims = list(range(x.ndim))
    elif isinstance(dims, int):
        dims = [dims]
    keepdim = bool(call.arg(dims_arg_index + 1, "keepdim", False))
    return sorted(norm_dim(d, x.ndim) for d in dims), keepdim


def _sum_like(call: OpCall, dims: list[int], keepdim: bool, localize=None) -> Signature:
    x = call.inputs[0]
    ins = tuple(f"r{i}" if i in dims else f"d{i}" for i in range(x.ndim))
    outs = tuple(f"^k{i}" if i in dims else f"d{i}" for i in range(x.ndim) if keepdim or i not in dims)
    return Signature(inputs=(ins,), outputs=(outs,), reduce=frozenset(f"r{i}" for i in dims), localize=localize)


@rule("aten.sum.dim_IntList", "aten.sum.default")
def sum_(call: OpCall) -> Signature:
    if str(call.target) == "aten.sum.default":
        return _sum_like(call, list(range(call.inputs[0].ndim)), False)
    dims, keepdim = _reduced(call)
    return _sum_like(call, dims, keepdim)


@rule("aten.mean.dim", "aten.mean.default")
def mean(call: OpCall) -> Signature:
    x = call.inputs[0]
    if str(call.target) == "aten.mean.default":
        dims, keepdim = list(range(x.ndim)), False
    else:
        dims, keepdim = _reduced(call)

    def localize(lc: LocalCall) -> Localized:
        split = [i for i in dims if f"r{i}" in lc.splits]
        if not split:
            return Localized(call.target, call.args, call.kwargs)
        factor = 1.0
        for i in split:
            factor /= lc.splits[f"r{i}"]
        dtype = call.kwargs.get("dtype")
        return Localized(piece_functions.scaled_mean, (call.args[0], dims, keepdim, factor, dtype))

    return _sum_like(call, dims, keepdim, localize)


@rule("aten.amax.default", "aten.amin.default", "aten.argmax.default", "aten.argmin.default",
      "aten.logsumexp.default", "aten.var.correction", "aten.std.correction", "aten.all.dim", "aten.any.dim")
def whole_reduction(call: OpCall) -> Signature:
    x = call.inputs[0]
    dims, keepdim = _reduced(call)
    ins = tuple(f"^r{i}" if i in dims else f"d{i}" for i in range(x.ndim))
    outs = tuple(f"^k{i}" if i in dims else f"d{i}" for i in range(x.ndim) if keepdim or i not in dims)
    return Signature(inputs=(ins,), outputs=tuple(outs if o is not None else None for o in call.outputs))


def _along_dim(call: OpCall, dim: int) -> Signature:
    """Ops that mix values along one dim (softmax, cumsum, diff, sort): that dim stays whole."""
    ins = []
    for t, m in enumerate(call.inputs):
        ins.append(tuple(f"^a{t}" if i == dim else f"d{i}" for i in range(m.ndim)))
    outs = tuple(tuple(f"^o{j}" if i == dim else f"d{i}" for i in range(o.ndim)) if o is not None else None
                 for j, o in enumerate(call.outputs))
    return Signature(inputs=tuple(ins), outputs=outs)


@rule("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default",
      "aten.cumsum.default", "aten.cumprod.default", "aten.diff.default", "aten.sort.default",
      "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable", "aten.topk.default")
def along_dim(call: OpCall) -> Signature:
    x = call.inputs[0]
    name = str(call.target)
    index = 2 if name.startswith("aten.topk") else 1
    dim = call.arg(index, "dim", -1)
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    return _along_dim(call, norm_dim(dim, x.ndim))


@rule("aten.histc.default")
def histc(call: OpCall) -> Signature:
    """Counts of values in `bins` equal bins of [min, max]: with a fixed range, the counts of the
    pieces of the input add up to the counts of the whole, so every input dim is a reduction.
    With min == max the range is the data's own minimum and maximum: kept whole."""
    x = call.inputs[0]
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if lo == hi:
        return None
    ins = tuple(f"r{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(("^bins",),), reduce=frozenset(ins))
