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


@rule("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default",
      "aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
      "aten._native_batch_norm_legit.no_stats", "aten._native_batch_norm_legit_functional.default",
      "aten.instance_norm.default")
def batch_norm(call: OpCall) -> Signature:
    """Batch norm normalizes each channel on its own: the channel dim of the input, the affine
    weight and bias and the running statistics may be split together (tensor parallelism over
    channels). In evaluation (running statistics used, not updated) every element is an affine
    map of itself, so the batch may be split too. In training the statistics are taken over the
    batch and the spatial dims, which therefore stay whole within one split op; and the running
    statistics are updated in place, which a piece could only do to its own chunk of them, so an
    op that updates them runs whole.

    Under data parallelism each replica runs the op on its own shard of the batch: batch
    statistics are the shard's and each replica updates its own running statistics from it,
    which is what DDP does without SyncBatchNorm (and with broadcast_buffers=False).
    """
    name = str(call.target)
    x = call.inputs[0]
    if name.startswith("aten._native_batch_norm_legit_functional"):
        return None  # returns the new running statistics as outputs: runs whole
    if name.startswith("aten._native_batch_norm_legit_no_training"):
        training, updates = False, False
    else:  # (input, weight, bias, running_mean, running_var, training | use_input_stats, ...)
        training = bool(call.arg(5, "training", call.arg(5, "use_input_stats", False)))
        running = call.arg(3, "running_mean") is not None
        updates = training and running and not name.startswith("aten._native_batch_norm_legit.no_stats")
    if updates:
        return None
    # instance norm takes statistics per sample: its batch dim is free even in training
    batch = "^b" if training and not name.startswith("aten.instance_norm") else "b"
    rest = tuple(f"^x{i}" for i in range(2, x.ndim))
    ins = [(batch, "c") + rest] + [("c",) if m.ndim == 1 and m.shape[0] == x.shape[1] else None
                                   for m in call.inputs[1:]]
    outs: list = [(batch, "c") + rest]
    for o in call.outputs[1:]:  # saved mean / inverse std: one per channel, or empty
        if o is not None and not (o.ndim == 1 and o.shape[0] == x.shape[1]):
            return None
        outs.append(("c",) if o is not None else None)
    return Signature(inputs=tuple(ins), outputs=tuple(outs))


@rule("aten._weight_norm.default")
def weight_norm(call: OpCall) -> Signature:
    """`v * (g / |v|)` with the norm taken over every dim but `dim`: that dim may be split (with
    `g`, which has its size there and 1 elsewhere); the normed dims stay whole."""
    v, g = call.inputs[0], call.inputs[1]
    dim = call.arg(2, "dim", 0)
    dim = dim + v.ndim if dim < 0 else dim
    if dim == -1 or not 0 <= dim < v.ndim:
        return None
    labs = tuple("k" if i == dim else f"^n{i}" for i in range(v.ndim))
    gl = tuple("k" if (i == dim and s == v.shape[dim]) else f"^g{i}" for i, s in enumerate(g.shape))
    return Signature(inputs=(labs, gl), outputs=(labs,))
