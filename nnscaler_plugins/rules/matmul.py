"""The matmul family: the contracted dim `k` is a reduction, every other dim is spatial.

Splitting `k` leaves each piece with a partial sum of the output; a bias (added once to the sum)
therefore enters as a partial input so that only one piece adds it.
"""
from __future__ import annotations

from nnscaler_plugins.rules.broadcast import broadcast_labels, out_labels
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature


@rule("aten.linear.default")
def linear(call: OpCall) -> Signature:
    x = call.inputs[0]
    batch = tuple(f"d{i}" for i in range(x.ndim - 1))
    ins = [batch + ("k",), ("n", "k")]
    partial = {}
    if len(call.inputs) == 3:
        ins.append(("n",))
        partial = {"k": frozenset({2})}
    return Signature(inputs=tuple(ins), outputs=(batch + ("n",),), reduce=frozenset({"k"}), partial_inputs=partial)


@rule("aten.addmm.default")
def addmm(call: OpCall) -> Signature:
    bias, a, b = call.inputs
    out = call.outputs[0]
    bias_labels = broadcast_labels(bias, out.shape, "bias", prefix="_")
    names = {"_0": "m", "_1": "n"}
    bias_labels = tuple(names.get(l, l) for l in bias_labels)
    return Signature(inputs=(bias_labels, ("m", "k"), ("k", "n")), outputs=(("m", "n"),), reduce=frozenset({"k"}),
                     partial_inputs={"k": frozenset({0})})


@rule("aten.mm.default")
def mm(call: OpCall) -> Signature:
    return Signature(inputs=(("m", "k"), ("k", "n")), outputs=(("m", "n"),), reduce=frozenset({"k"}))


@rule("aten.bmm.default")
def bmm(call: OpCall) -> Signature:
    return Signature(inputs=(("b", "m", "k"), ("b", "k", "n")), outputs=(("b", "m", "n"),), reduce=frozenset({"k"}))


@rule("aten.baddbmm.default")
def baddbmm(call: OpCall) -> Signature:
    bias = call.inputs[0]
    out = call.outputs[0]
    names = {"_0": "b", "_1": "m", "_2": "n"}
    bias_labels = tuple(names.get(l, l) for l in broadcast_labels(bias, out.shape, "bias", prefix="_"))
    return Signature(inputs=(bias_labels, ("b", "m", "k"), ("b", "k", "n")), outputs=(("b", "m", "n"),),
                     reduce=frozenset({"k"}), partial_inputs={"k": frozenset({0})})


@rule("aten.matmul.default")
def matmul(call: OpCall) -> Signature:
    """torch.matmul with its 1-D and broadcast-batch cases."""
    a, b = call.inputs
    out = call.outputs[0]
    if a.ndim == 1 and b.ndim == 1:
        return Signature(inputs=(("k",), ("k",)), outputs=((),), reduce=frozenset({"k"}))
    if a.ndim == 1:  # (k) @ (..., k, n) -> (..., n)
        nb = b.ndim - 2
        batch = tuple(f"d{i}" for i in range(nb))
        return Signature(inputs=(("k",), batch + ("k", "n")), outputs=(batch + ("n",),), reduce=frozenset({"k"}))
    if b.ndim == 1:  # (..., m, k) @ (k) -> (..., m)
        na = a.ndim - 2
        batch = tuple(f"d{i}" for i in range(na))
        return Signature(inputs=(batch + ("m", "k"), ("k",)), outputs=(batch + ("m",),), reduce=frozenset({"k"}))
    nbatch = out.ndim - 2
    bshape = out.shape[:nbatch]

    def labels(t, tag):
        lead = broadcast_labels(type(t)(t.shape[:-2], t.dtype), bshape, tag) if t.ndim > 2 else ()
        return lead

    la = labels(a, "a") + ("m", "k")
    lb = labels(b, "b") + ("k", "n")
    return Signature(inputs=(la, lb), outputs=(out_labels(nbatch) + ("m", "n"),), reduce=frozenset({"k"}))


@rule("aten.conv2d.default", "aten.conv1d.default")
def conv(call: OpCall) -> Signature:
    """Batch and output channels are spatial; input channels are a reduction (groups == 1).
    Spatial extents stay whole (a split would need halo exchange)."""
    x, w = call.inputs[0], call.inputs[1]
    groups = call.arg(6, "groups", 1)
    extra = tuple(f"^x{i}" for i in range(x.ndim - 2))
    kern = tuple(f"^w{i}" for i in range(w.ndim - 2))
    outs = tuple(f"^o{i}" for i in range(x.ndim - 2))
    cin = "c" if groups == 1 else "^c"
    cw = "c" if groups == 1 else "^cw"
    o = "o" if groups == 1 else "^o"
    ins = [("b", cin) + extra, (o, cw) + kern]
    partial = {}
    if len(call.inputs) == 3:
        ins.append((o,))
        partial = {"c": frozenset({2})} if groups == 1 else {}
    return Signature(inputs=tuple(ins), outputs=(("b", o) + outs,),
                     reduce=frozenset({"c"}) if groups == 1 else frozenset(), partial_inputs=partial)
