"""View and movement ops: labels follow the data. A reshape splits or merges groups of dims; the
leading dim of a group may be split (its chunks are contiguous in the merged dim). An inner dim of
a merge (h of (b, h) -> b*h) or of a split may be split too: its chunks sit in every one of the b
blocks of the merged dim, a blocked split (`Signature.merged`). Size arguments are rewritten to the
piece's local shape.
"""
from __future__ import annotations

import math
from typing import Optional

from nnscaler_plugins.rules.broadcast import norm_dim
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[list[tuple[list[int], list[int]]]]:
    """Pair runs of dims of src and dst with equal products (size-1 dims get their own group)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            return None
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= len(src):
                    return None
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(dst):
                    return None
                pj *= dst[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def _local_shape(lc: LocalCall, out: int = 0) -> list[int]:
    meta = lc.local_outputs[out]
    assert meta is not None
    return list(meta.shape)


def _reshape_localize(call: OpCall, size_index: int = 1):
    def localize(lc: LocalCall) -> Localized:
        args = list(call.args)
        args[size_index] = _local_shape(lc)
        return Localized(call.target, tuple(args), call.kwargs)
    return localize


@rule("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
def view(call: OpCall) -> Signature:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    groups = _groups(tuple(src), tuple(dst))
    if groups is None:
        return None
    ins: list[str] = [""] * len(src)
    outs: list[str] = [""] * len(dst)
    merged: dict[str, tuple[str, int]] = {}
    for g, (gi, gj) in enumerate(groups):
        for k, i in enumerate(gi):
            ins[i] = f"g{g}" if k == 0 and gj else f"^i{i}"
        for k, j in enumerate(gj):
            outs[j] = f"g{g}" if k == 0 and gi else f"^o{j}"
        # A merge (b, h) -> b*h or a split b*h -> (b, h): the inner dims may be split too; the
        # merged dim then holds the split in as many blocks as the dims before it count.
        inner, dims, shape = (gi, ins, src) if len(gj) == 1 else (gj, outs, dst) if len(gi) == 1 else ((), (), ())
        for k, d in enumerate(inner[1:], start=1):
            if shape[d] > 1:
                dims[d] = f"g{g}_{k}"
                merged[dims[d]] = (f"g{g}", math.prod(shape[x] for x in inner[:k]))
    return Signature(inputs=(tuple(ins),), outputs=(tuple(outs),), localize=_reshape_localize(call), merged=merged)


@rule("aten.flatten.using_ints")
def flatten(call: OpCall) -> Signature:
    x = call.inputs[0]
    start = norm_dim(call.arg(1, "start_dim", 0), x.ndim)
    end = norm_dim(call.arg(2, "end_dim", -1), x.ndim)
    merged = {f"g{start}_{i}": (f"g{start}", math.prod(x.shape[start:i])) for i in range(start + 1, end + 1)
              if x.shape[i] > 1}  # inner dims of the flattened group: blocked in the merged dim (see `view`)
    ins = tuple(f"d{i}" if i < start else (f"g{start}" if i == start else (
        (f"g{start}_{i}" if f"g{start}_{i}" in merged else f"^i{i}") if i <= end else f"e{i}")) for i in range(x.ndim))
    outs = tuple(f"d{i}" for i in range(start)) + (f"g{start}",) + tuple(f"e{i}" for i in range(end + 1, x.ndim))
    return Signature(inputs=(ins,), outputs=(outs,), merged=merged)


@rule("aten.expand.default", "aten.broadcast_to.default")
def expand(call: OpCall) -> Signature:
    """`x.expand(*sizes)` and `torch.broadcast_to(x, sizes)`: dims kept at their size follow the
    output; broadcast ones are whole."""
    x, out = call.inputs[0], call.outputs[0]
    n, m = out.ndim, x.ndim
    ins = tuple(f"d{j + n - m}" if s == out.shape[j + n - m] else f"^b{j}" for j, s in enumerate(x.shape))
    return Signature(inputs=(ins,), outputs=(tuple(f"d{i}" for i in range(n)),), localize=_reshape_localize(call))


@rule("aten.unsqueeze.default")
def unsqueeze(call: OpCall) -> Signature:
    x, out = call.inputs[0], call.outputs[0]
    d = norm_dim(call.arg(1, "dim"), out.ndim)
    ins = tuple(f"d{i}" for i in range(x.ndim))
    outs = ins[:d] + ("^new",) + ins[d:]
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def squeeze(call: OpCall) -> Signature:
    x = call.inputs[0]
    dims = call.arg(1, "dim", None)
    if dims is None:
        dims = [i for i, s in enumerate(x.shape) if s == 1]
    elif isinstance(dims, int):
        dims = [dims]
    dims = {norm_dim(d, x.ndim) for d in dims if x.shape[norm_dim(d, x.ndim)] == 1}
    ins = tuple(f"^s{i}" if i in dims else f"d{i}" for i in range(x.ndim))
    outs = tuple(l for l in ins if not l.startswith("^s"))
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.transpose.int")
def transpose(call: OpCall) -> Signature:
    x = call.inputs[0]
    a, b = norm_dim(call.arg(1, "dim0"), x.ndim), norm_dim(call.arg(2, "dim1"), x.ndim)
    ins = [f"d{i}" for i in range(x.ndim)]
    outs = list(ins)
    outs[a], outs[b] = outs[b], outs[a]
    return Signature(inputs=(tuple(ins),), outputs=(tuple(outs),))


@rule("aten.t.default", "aten.numpy_T.default")
def t(call: OpCall) -> Signature:
    """`x.t()` and `x.T` (numpy_T): the dims in reverse order."""
    x = call.inputs[0]
    ins = tuple(f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(tuple(reversed(ins)),))


@rule("aten.permute.default")
def permute(call: OpCall) -> Signature:
    x = call.inputs[0]
    order = [norm_dim(d, x.ndim) for d in call.arg(1, "dims")]
    ins = tuple(f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(tuple(ins[i] for i in order),))


@rule("aten.slice.Tensor", "aten.narrow.default")
def slice_(call: OpCall) -> Signature:
    x = call.inputs[0]
    d = norm_dim(call.arg(1, "dim", 0), x.ndim)
    ins = tuple("^in" if i == d else f"d{i}" for i in range(x.ndim))
    outs = tuple("^out" if i == d else f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.select.int")
def select(call: OpCall) -> Signature:
    x = call.inputs[0]
    d = norm_dim(call.arg(1, "dim"), x.ndim)
    ins = tuple("^sel" if i == d else f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(tuple(l for l in ins if l != "^sel"),))


@rule("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int")
def split(call: OpCall) -> Signature:
    """Equal sections may split the sectioned dim *blockwise*: every piece takes its chunk of each
    section, so each output is split contiguously (a fused QKV projection cut into q, k, v)."""
    x = call.inputs[0]
    name = str(call.target)
    dim = norm_dim(call.arg(2 if not name.startswith("aten.unbind") else 1, "dim", 0), x.ndim)
    outs_meta = [o for o in call.outputs]
    sizes = [o.shape[dim] if o is not None and not name.startswith("aten.unbind") else None for o in outs_meta]
    base = [f"d{i}" for i in range(x.ndim)]
    if name.startswith("aten.unbind"):
        ins = tuple("^u" if i == dim else base[i] for i in range(x.ndim))
        outs = tuple(tuple(b for i, b in enumerate(base) if i != dim) if o is not None else None for o in outs_meta)
        return Signature(inputs=(ins,), outputs=outs)
    equal = all(s is not None for s in sizes) and len(set(sizes)) == 1 and sizes[0] * len(sizes) == x.shape[dim]
    sec = "q" if equal else "^in"
    ins = tuple(sec if i == dim else base[i] for i in range(x.ndim))
    outs = tuple(tuple((sec if equal else f"^out{j}") if i == dim else base[i] for i in range(x.ndim))
                 if o is not None else None for j, o in enumerate(outs_meta))
    blocks = {("q", 0): len(sizes)} if equal and len(sizes) > 1 else {}

    def localize(lc: LocalCall) -> Localized:
        if "q" not in lc.splits:
            return Localized(call.target, call.args, call.kwargs)
        args = list(call.args)
        n = lc.splits["q"]
        if name.startswith("aten.split.Tensor"):
            args[1] = args[1] // n
        elif name.startswith("aten.split_with_sizes"):
            args[1] = [s // n for s in args[1]]
        return Localized(call.target, tuple(args), call.kwargs)

    return Signature(inputs=(ins,), outputs=outs, blocks=blocks, localize=localize)


@rule("aten.cat.default")
def cat(call: OpCall) -> Signature:
    out = call.outputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    ins = []
    for t, m in enumerate(call.inputs):
        if m.ndim != out.ndim:  # legacy empty tensors
            return None
        ins.append(tuple(f"^c{t}" if i == dim else f"d{i}" for i in range(m.ndim)))
    return Signature(inputs=tuple(ins), outputs=(tuple("^out" if i == dim else f"d{i}" for i in range(out.ndim)),))


@rule("aten.stack.default")
def stack(call: OpCall) -> Signature:
    out = call.outputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    ins = tuple(tuple(f"d{i if i < dim else i + 1}" for i in range(m.ndim)) for m in call.inputs)
    return Signature(inputs=ins, outputs=(tuple("^new" if i == dim else f"d{i}" for i in range(out.ndim)),))


@rule("aten.pad.default", "aten.constant_pad_nd.default")
def pad(call: OpCall) -> Signature:
    x = call.inputs[0]
    p = list(call.arg(1, "pad"))
    padded = {x.ndim - 1 - k // 2 for k in range(len(p)) if p[k] != 0}
    ins = tuple(f"^p{i}" if i in padded else f"d{i}" for i in range(x.ndim))
    outs = tuple(f"^q{i}" if i in padded else f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.index.Tensor", "aten.gather.default", "aten.index_select.default", "aten.masked_select.default",
      "aten.nonzero.default", "aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
      "aten.repeat_interleave.self_Tensor", "aten.repeat_interleave.Tensor")
def gather_like(call: OpCall) -> Signature:
    """Data-dependent indexing: kept whole (replicated) by design; cheap in the graphs where it
    appears (masks and position ids)."""
    return Signature(inputs=tuple(None for _ in call.inputs), outputs=tuple(None for _ in call.outputs),
                     note="data-dependent indexing runs whole")


@rule("aten.repeat.default")
def repeat(call: OpCall) -> Signature:
    """`x.repeat(*sizes)`: a dim repeated once keeps its data in place and may be split; a dim
    repeated r > 1 times holds r copies one after the other, so a contiguous chunk of the output is
    not a chunk of the input: it stays whole, as do the leading dims `sizes` adds."""
    x, out = call.inputs[0], call.outputs[0]
    reps = list(call.arg(1, "repeats"))
    lead = len(reps) - x.ndim
    ins = tuple(f"d{j + lead}" if reps[j + lead] == 1 else f"^r{j}" for j in range(x.ndim))
    outs = tuple(f"d{i}" if i >= lead and reps[i] == 1 else f"^o{i}" for i in range(out.ndim))
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.repeat_interleave.self_int")
def repeat_interleave(call: OpCall) -> Signature:
    """`x.repeat_interleave(r, dim)` with an int r: output index j reads input index j // r, so
    chunk i of the output is exactly the repetition of chunk i of the input, along every dim
    (the repeated dim carries one label with sizes L and L * r). Without `dim` the input is
    flattened first: kept whole."""
    x = call.inputs[0]
    dim = call.arg(2, "dim", None)
    if dim is None:
        return Signature(inputs=(None,), outputs=(None,), note="repeat_interleave of the flattened input")
    labs = tuple(f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(labs,), outputs=(labs,))


@rule("aten.roll.default")
def roll(call: OpCall) -> Signature:
    """Rolled dims move data between chunks: whole; the others may be split. A roll without dims
    rolls the flattened tensor: every dim whole."""
    x = call.inputs[0]
    dims = call.arg(2, "dims", [])
    dims = [dims] if isinstance(dims, int) else list(dims)
    rolled = {norm_dim(d, x.ndim) for d in dims} if dims else set(range(x.ndim))
    ins = tuple(f"^r{i}" if i in rolled else f"d{i}" for i in range(x.ndim))
    outs = tuple(f"^o{i}" if i in rolled else f"d{i}" for i in range(x.ndim))
    return Signature(inputs=(ins,), outputs=(outs,))


@rule("aten.index_put.default")
def index_put(call: OpCall) -> Signature:
    """`x[indices] = values`: the indexed (leading) dims of `x` are addressed by data and stay
    whole, as do the indices; the dims after them are plain slices, split alike in `x`, `values`
    (where it has them at full size) and the output. The indices tensors, `accumulate` and their
    broadcast only decide where values land, never the size of a trailing dim."""
    x = call.inputs[0]
    indices = call.arg(1, "indices")
    k = len(indices)
    labels = tuple(f"^i{i}" if i < k else f"d{i}" for i in range(x.ndim))
    n_index = sum(1 for i in indices if i is not None and call.input_index(i) is not None)
    idx = tuple(tuple(f"^x{t}_{j}" for j in range(call.inputs[1 + t].ndim)) for t in range(n_index))
    values = call.inputs[1 + n_index]
    trailing = x.ndim - k
    vl = []
    for j, s in enumerate(values.shape):
        i = x.ndim - values.ndim + j  # values broadcast against x[indices], whose trailing dims are x's
        vl.append(f"d{i}" if j >= values.ndim - trailing and i >= k and s == x.shape[i] else f"^v{j}")
    return Signature(inputs=(labels,) + idx + (tuple(vl),), outputs=(labels,))
